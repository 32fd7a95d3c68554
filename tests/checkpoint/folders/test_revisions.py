"""A later revision of a step (``step-N.rK/``) supersedes its committed checkpoint: written beside it,
so the old one stays the resume point until the new manifest lands; readers take the highest
revision, and ``prune`` deletes the superseded ones (``AcceleratorGuard``'s cut evaluations use it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard import checkpoint
from spotguard.checkpoint.folders import layout
from spotguard.checkpoint.format.manifest import MANIFEST, dir_order
from spotguard.errors import ConfigError
from spotguard.integrations._common import FolderCheckpoints
from spotguard.storage import open_storage


def folder(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "state.bin").write_text(text)
    return root


def names(storage) -> list[str]:
    return [i.name for i in checkpoint.scan(storage)]


def test_revision_names_sort_after_their_step_and_before_the_next() -> None:
    assert checkpoint.step_dir(12, 0) == "step-00000012" and checkpoint.step_dir(12, 3) == "step-00000012.r3"
    assert checkpoint.parse_step_dir("step-00000012.r3") == 12 and dir_order("step-00000012.r3") == (12, 3)
    ordered = sorted(["step-00000013", "step-00000012.r10", "step-00000012", "step-00000012.r2"], key=dir_order)
    assert ordered == ["step-00000012", "step-00000012.r2", "step-00000012.r10", "step-00000013"]
    for name in ("step-00000012.r0", "step-00000012.r01", "step-00000012.x1", "step-00000012.r"):
        assert checkpoint.parse_step_dir(name) is None, name  # one spelling per revision
    with pytest.raises(ConfigError):
        checkpoint.step_dir(12, -1)


def test_a_revision_is_the_resume_point_once_committed_and_prune_drops_what_it_superseded(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "ckpt"))
    for step in (4, 8):
        checkpoint.write_dir(storage, step, folder(tmp_path / f"s{step}", f"periodic {step}"), reason="periodic")
    assert layout.next_revision(storage, 8) == 1 and layout.next_revision(storage, 9) == 0

    # Killed before its manifest: the periodic checkpoint of step 8 is still the resume point.
    (tmp_path / "ckpt" / "step-00000008.r1").mkdir()
    (tmp_path / "ckpt" / "step-00000008.r1" / "state.bin").write_text("half")
    latest = checkpoint.latest(storage)
    assert latest is not None and latest.name == "step-00000008"
    assert layout.next_revision(storage, 8) == 1  # the leftover is replaced, not skipped

    # Committed, and killed before the old one was deleted: both are complete, the revision is newer.
    checkpoint.write_dir(storage, 8, folder(tmp_path / "cut", "cut 8"), reason="emergency", revision=1)
    assert names(storage) == ["step-00000004", "step-00000008", "step-00000008.r1"]
    latest = checkpoint.latest(storage)
    assert latest is not None and latest.name == "step-00000008.r1" and latest.revision == 1
    assert checkpoint.fetch(storage, latest, tmp_path / "got").joinpath("state.bin").read_text() == "cut 8"

    # The superseded one goes and does not count among the `keep`: step 4 stays.
    assert checkpoint.prune(storage, keep=2) == [8]
    assert names(storage) == ["step-00000004", "step-00000008.r1"]
    assert layout.next_revision(storage, 8) == 2


def test_an_incomplete_lower_revision_goes_but_a_higher_one_is_left(tmp_path) -> None:
    storage = open_storage(str(tmp_path / "ckpt"))
    checkpoint.write_dir(storage, 8, folder(tmp_path / "r1", "cut"), reason="emergency", revision=1)
    for name in ("step-00000008", "step-00000008.r2"):  # a deletion killed part way; a later save killed
        (tmp_path / "ckpt" / name).mkdir()
        (tmp_path / "ckpt" / name / "state.bin").write_text("left")
    checkpoint.prune(storage, keep=3)
    assert names(storage) == ["step-00000008.r1", "step-00000008.r2"]  # the other for `spotguard rm --incomplete`


def test_folder_checkpoints_supersede_a_committed_step_and_resume_from_the_new_state(tmp_path) -> None:
    checkpoints = FolderCheckpoints(str(tmp_path / "ckpt"), keep=2, lease_ttl=None, work_dir=str(tmp_path / "w"))
    checkpoints.commit(8, folder(tmp_path / "a", "before the evaluation"), "periodic")
    assert checkpoints.commit(8, folder(tmp_path / "b", "again"), "emergency") is None  # never twice
    manifest = checkpoints.commit(8, folder(tmp_path / "c", "the evaluation's state"), "emergency", supersede=True)
    assert manifest is not None and manifest.reason == "emergency"
    # An emergency commit prunes nothing (the deadline's clock): the superseded revision waits for the next save.
    assert names(checkpoints.storage) == ["step-00000008", "step-00000008.r1"]
    found = checkpoints.newest_verified()
    assert found is not None and found[0] == 8 and (found[1] / "state.bin").read_text() == "the evaluation's state"
    checkpoints.commit(9, folder(tmp_path / "d", "on"), "periodic")
    assert names(checkpoints.storage) == ["step-00000008.r1", "step-00000009"]
    assert not (tmp_path / "ckpt" / "step-00000008" / MANIFEST).exists()
    checkpoints.cleanup()


def test_ls_names_a_revision_and_pull_takes_the_highest(tmp_path, capsys) -> None:
    from spotguard.ops.cli import main

    storage = open_storage(str(tmp_path / "ckpt"))
    checkpoint.write_dir(storage, 8, folder(tmp_path / "a", "periodic"), reason="periodic")
    checkpoint.write_dir(storage, 8, folder(tmp_path / "b", "cut"), reason="emergency", revision=1)
    assert main(["ls", str(tmp_path / "ckpt")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:3]]
    assert [(r[0], r[3]) for r in rows] == [("8", "periodic"), ("8.r1", "emergency")]
    assert main(["pull", str(tmp_path / "ckpt"), str(tmp_path / "dest"), "--step", "8"]) == 0
    assert (tmp_path / "dest" / "step-00000008.r1" / "state.bin").read_text() == "cut"
