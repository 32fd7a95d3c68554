"""Which files one node fetches for a resume (spotguard/checkpoint/folders/pernode.py): pure functions of names; and
the private folder its copy goes to."""

from __future__ import annotations

import os
import stat

import pytest

from spotguard.checkpoint.folders import pernode
from spotguard.errors import ConfigError

NAMES = ["model.bin", "own-0", "own-1", "own-2", "own-3", "own-7"]


def own(name: str) -> int | None:
    return int(name[4:]) if name.startswith("own-") else None


def test_a_node_needs_the_shared_files_and_its_own_ranks_files_only():
    assert pernode.needed(NAMES, own, {1}, world=4) == ["model.bin", "own-1", "own-7"]
    assert pernode.needed(NAMES, own, {2, 3}, world=4) == ["model.bin", "own-2", "own-3", "own-7"]


def test_a_rank_the_job_does_not_have_is_a_name_the_rule_does_not_know_and_is_fetched():
    assert "own-7" in pernode.needed(NAMES, own, {0}, world=4)  # rank 7 of 4: fetched, not left out
    assert pernode.needed(NAMES, own, set(range(8)), world=8) == NAMES


def test_every_file_is_fetched_when_the_world_size_changed_or_any_rank_is_unsure():
    assert pernode.why_everything(2, 2, ["", ""]) == ""
    why = pernode.why_everything(4, 2, ["", ""])
    assert "4 ranks" in why and "this job has 2" in why and "resharding" in why
    assert pernode.why_everything(2, 2, ["", "elastic"]) == "elastic"  # one rank's doubt is every node's
    assert pernode.why_everything(2, 2, ["b", "a", "b"]) == "a; b"


def _committed(tmp_path):
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    storage = open_storage(str(tmp_path / "ckpt"))
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "model.bin").write_bytes(b"verified weights")
    checkpoint.write_dir(storage, 5, tmp_path / "trainer", reason="periodic")
    return storage, checkpoint.latest(storage)


def test_a_node_folder_planted_by_another_user_never_receives_the_checkpoint(tmp_path, monkeypatch):
    """The name every rank of a node computes is predictable: a link planted at it (multi-user nodes)
    must not receive the verified files, which the trainer then unpickles."""
    import hashlib
    import tempfile

    from spotguard.checkpoint.folders import folders

    shared_tmp, theirs = tmp_path / "tmp", tmp_path / "theirs"
    shared_tmp.mkdir()
    theirs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    storage, info = _committed(tmp_path)
    tag = hashlib.sha256(storage.describe().encode()).hexdigest()[:12]
    for name in (f"spotguard-{tag}-node0-step-00000005", f"{tag}-node0-step-00000005"):
        (shared_tmp / name).symlink_to(theirs, target_is_directory=True)
    dest = folders.node_folder(storage, 5, None)
    folders._fetch_into(storage, info, dest, None, "", frozenset({0}))
    assert (dest / "model.bin").read_bytes() == b"verified weights"
    assert list(theirs.iterdir()) == []
    assert dest.parent == shared_tmp / f"spotguard-{os.geteuid()}" and not dest.is_symlink()
    assert stat.S_IMODE(dest.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("planted", ["link", "open", "file"])
def test_a_private_folder_that_is_not_ours_is_refused(tmp_path, planted):
    private = tmp_path / f"spotguard-{os.geteuid()}"
    if planted == "link":
        (tmp_path / "theirs").mkdir()
        private.symlink_to(tmp_path / "theirs", target_is_directory=True)
    elif planted == "open":
        private.mkdir()
        private.chmod(0o777)
    else:
        private.write_bytes(b"")
    with pytest.raises(ConfigError, match="not this user's private folder"):
        pernode.private_folder(str(tmp_path))
