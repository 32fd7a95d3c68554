"""A local checkpoint folder that cannot be listed is an error, never "no checkpoints": read as empty,
it made `resume()` return 0 (training from scratch, silently) and `spotguard ls` exit 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.errors import StorageAccessError, StorageError
from spotguard.ops.cli import main
from spotguard.storage import open_storage
from tests.helpers import WORKERS, subprocess_env


def a_checkpoint(root: Path) -> None:
    guard = spotguard.Guard(str(root), every_steps=None, providers=[], save_on_exit=False, lease_ttl=None)
    guard.track(x=torch.arange(4.0)).save(7)


def test_a_root_below_a_file_is_a_storage_error_for_the_listing_resume_and_ls(tmp_path, capsys):
    """A path component that is a file (a typo, a mount missing): works as root too."""
    (tmp_path / "file").write_text("not a folder")
    url = str(tmp_path / "file" / "ckpt")
    with pytest.raises(StorageAccessError, match="cannot list .*: Not a directory"):
        open_storage(url).list_sizes()
    with pytest.raises(StorageError, match="cannot list"):
        spotguard.Guard(url, providers=[], lease_ttl=None).track(x=torch.zeros(4)).resume()
    assert main(["ls", url]) == 2
    err = capsys.readouterr().err
    assert "spotguard: error: cannot list" in err and "Not a directory" in err, err


def test_a_root_that_does_not_exist_yet_is_still_empty(tmp_path):
    assert open_storage(str(tmp_path / "new")).list_sizes() == {}
    assert open_storage(str(tmp_path)).list_sizes("step-00000001/") == {}


RESUME_THEN_LS = textwrap.dedent("""
    import sys, torch, spotguard
    from spotguard.ops.cli import main
    url = sys.argv[1]
    try:
        print("resumed at", spotguard.Guard(url, providers=[], lease_ttl=None).track(x=torch.zeros(4)).resume())
    except spotguard.errors.StorageError as e:
        print(f"resume failed ({type(e).__name__}):", e)
    sys.stdout.flush()
    sys.exit(main(["ls", url]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("unreadable", ["root", "step folder"])
def test_an_unreadable_folder_fails_resume_and_ls_with_a_clear_message(tmp_path, unreadable):
    """chmod 000 on the root or on a step folder; as root the check runs with the capabilities that
    bypass permissions dropped (tests/workers/obey_permissions.py), so the refusal is real."""
    root = tmp_path / "ckpt"
    a_checkpoint(root)
    target = root if unreadable == "root" else root / "step-00000007"
    script = tmp_path / "resume_then_ls.py"
    script.write_text(RESUME_THEN_LS)
    target.chmod(0)
    try:
        proc = subprocess.run(
            [sys.executable, str(WORKERS / "obey_permissions.py"), str(script), str(root)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        target.chmod(0o755)
    if proc.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here: root would read the folder anyway")
    assert "resume failed (StorageAccessError): cannot list" in proc.stdout and "Permission denied" in proc.stdout, proc
    assert proc.returncode == 2 and "spotguard: error: cannot list" in proc.stderr, proc
    assert "Traceback" not in proc.stderr and "no checkpoints" not in proc.stdout, proc


def test_a_lost_and_found_folder_at_a_mount_point_root_is_not_ours_and_not_an_error(tmp_path):
    """Where the root is a file system's mount point: its lost+found is unreadable to all but root
    (the listing runs with permissions enforced, see above)."""
    a_checkpoint(tmp_path)
    (tmp_path / "lost+found").mkdir(mode=0)
    script = tmp_path / "list.py"
    script.write_text(
        f"from spotguard.storage import open_storage\nprint(sorted(open_storage({str(tmp_path)!r}).list()))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(WORKERS / "obey_permissions.py"), str(script)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        (tmp_path / "lost+found").chmod(0o755)
    if proc.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here")
    assert proc.returncode == 0 and "step-00000007/manifest.json" in proc.stdout and "list.py" in proc.stdout, proc
