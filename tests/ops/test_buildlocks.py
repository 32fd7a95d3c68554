"""``spotguard run`` clears a torch build lock its killed attempt left, so the restart does not wait on
it forever (every DeepSpeed job on CPU builds or checks its shared-memory op under such a lock)."""

from __future__ import annotations

import os
import sys
import textwrap

from spotguard.ops.supervisor import buildlocks
from tests.ops.test_supervisor import run_cmd, supervise


def test_a_lock_no_process_holds_is_removed_and_a_held_one_is_kept(tmp_path):
    for name in ("left", "held", "built"):
        (tmp_path / name).mkdir()
    (tmp_path / "left" / "lock").touch()
    (tmp_path / "held" / "lock").touch()
    (tmp_path / "built" / "op.so").touch()
    fd = os.open(tmp_path / "held" / "lock", os.O_RDONLY)  # as torch's builder holds it while it builds
    try:
        assert buildlocks.clear_stale(tmp_path) == [tmp_path / "left" / "lock"]
    finally:
        os.close(fd)
    assert (tmp_path / "held" / "lock").exists() and (tmp_path / "built" / "op.so").exists()
    assert buildlocks.clear_stale(tmp_path) == [tmp_path / "held" / "lock"]  # let go of: a leftover too


def test_the_folder_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert buildlocks.folder() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert buildlocks.folder() == tmp_path / "cache" / "torch_extensions"


def test_a_restart_after_an_attempt_killed_mid_build_finds_no_lock(tmp_path):
    ext = tmp_path / "ext"
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            from pathlib import Path
            lock, first = Path({str(ext)!r}) / "op" / "lock", Path({str(tmp_path)!r}) / "first"
            if not first.exists():  # the first attempt dies holding the build lock
                first.touch()
                lock.parent.mkdir(parents=True)
                lock.touch()
                os.kill(os.getpid(), 9)
            sys.exit(5 if lock.exists() else 0)  # 5: a real build would wait for it forever
            """
        )
    )
    proc = supervise(run_cmd(tmp_path / "ckpt", child=[sys.executable, str(job)]), TORCH_EXTENSIONS_DIR=str(ext))
    assert proc.returncode == 0, proc.stderr
    assert f"removed {ext / 'op' / 'lock'}, a build lock no process holds" in proc.stderr
    assert proc.stderr.count("starting: ") == 2
