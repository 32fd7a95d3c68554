"""Names that must not alias: a checkpoint's own file is never taken for a temp file, a folder named
almost like a step is never taken for one, and a ``step-N`` link never leads a save out of the root."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spotguard import checkpoint
from spotguard.checkpoint.folders import cleanup
from spotguard.errors import ConfigError, StorageError
from spotguard.storage import open_storage


def save(storage, step: int, files: dict[str, bytes]) -> None:
    checkpoint.write(storage, step, {n: (lambda f, d=d: f.write(d)) for n, d in files.items()}, reason="periodic")


@pytest.mark.parametrize("name", ["data.tmp-1", "shard.tmp-host-00000000", "a.tmp-/b.bin", "x.sg-part-1"])
def test_a_checkpoint_file_named_like_a_temp_file_is_listed_and_never_garbage(tmp_path, name):
    storage = open_storage(str(tmp_path))
    save(storage, 5, {name: b"legal", "state.pt": b"state"})
    save(storage, 6, {"state.pt": b"newer"})
    (info, _) = checkpoint.scan(storage)
    assert info.complete, info.problem
    assert cleanup.plan(storage, 0).garbage == []
    checkpoint.prune(storage, keep=2)
    assert (tmp_path / "step-00000005" / name).read_bytes() == b"legal"


@pytest.mark.parametrize(
    "name", ["state.pt.tmp-host@12-0123abcd", "state.pt.sg-part-0123456789ab-00", "shards/x.sg-part-0123456789ab-117"]
)
def test_a_file_name_a_backend_keeps_for_temp_objects_is_refused_at_save(tmp_path, name):
    storage = open_storage(str(tmp_path))
    with pytest.raises(ConfigError, match="temp objects|invalid checkpoint file name"):
        save(storage, 5, {name: b"x"})
    assert checkpoint.scan(storage) == []


@pytest.mark.parametrize(
    "alias", ["step-00000005.r2\n", "step-00000005\n", "step-0000000\u0665.r2", "step-000000005.r2"]
)
def test_a_folder_named_almost_like_a_step_is_ignored_and_never_supersedes_it(tmp_path, alias):
    storage = open_storage(str(tmp_path))
    save(storage, 4, {"state.pt": b"four"})
    save(storage, 5, {"state.pt": b"five"})
    shutil.copytree(tmp_path / "step-00000005", tmp_path / alias)
    assert [i.name for i in checkpoint.scan(storage)] == ["step-00000004", "step-00000005"]
    assert checkpoint.parse_step_dir(alias) is None
    latest = checkpoint.latest(storage)
    assert latest is not None and latest.name == "step-00000005"
    checkpoint.prune(storage, keep=1)
    assert (tmp_path / "step-00000005" / "state.pt").read_bytes() == b"five"
    assert (tmp_path / alias / "state.pt").exists()  # not ours: left alone


def test_a_step_folder_that_is_a_link_is_never_cleared_or_written_through(tmp_path):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_bytes(b"keep me")
    storage = open_storage(str(root))
    save(storage, 4, {"state.pt": b"four"})
    (root / "step-00000005").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StorageError, match="step-00000005 is a link"):
        save(storage, 5, {"state.pt": b"five"})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.bin"]
    assert (elsewhere / "precious.bin").read_bytes() == b"keep me"
    with pytest.raises(StorageError, match="is a link"):
        storage.delete(["step-00000005/precious.bin"])
    assert (elsewhere / "precious.bin").exists()
    assert [i.name for i in checkpoint.scan(storage)] == ["step-00000004"]


def test_a_link_inside_the_root_to_another_step_is_not_followed_either(tmp_path):
    storage = open_storage(str(tmp_path))
    save(storage, 4, {"state.pt": b"four"})
    Path(tmp_path / "step-00000005").symlink_to("step-00000004", target_is_directory=True)
    with pytest.raises(StorageError, match="is a link"):
        save(storage, 5, {"state.pt": b"five"})
    assert checkpoint.verify(storage, checkpoint.latest(storage)) is None
