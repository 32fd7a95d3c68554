"""A checkpoint that a resume finds unlike its manifest (bit rot at the same size) stops counting as one.

Its listing still looked committed, so retention counted it among the ``keep``, the newest too: with
``keep=2`` the resumed run kept one good checkpoint, with ``keep=1`` none (each commit pruned at once,
the resume point too), and a save of its step was refused as already committed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spotguard import Guard
from spotguard.checkpoint import scan
from spotguard.checkpoint.format.manifest import step_dir
from spotguard.checkpoint.format.reader import CORRUPT_MARK
from spotguard.storage import open_storage


def _train(storage: Path, start_at: int, steps: int, every: int, keep: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    guard = Guard(str(storage), providers=[], every_steps=every, keep=keep, busy="wait", save_on_exit=False)
    guard.track(model=model)
    start = guard.resume()
    assert start == start_at
    with guard:
        for step in range(start, steps):
            model.weight.data.add_(0.01)
            guard.step(step + 1)
    return start


def _rot(folder: Path) -> None:
    """Flip one byte of the biggest file: the size stays, the checksum does not."""
    path = max(
        (p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _statuses(storage: Path) -> dict[int, str]:
    return {i.step: i.status for i in scan(open_storage(str(storage)))}


def test_a_rotten_newest_checkpoint_is_marked_and_neither_counted_nor_kept_in_the_way(tmp_path, engine):
    storage = tmp_path / "ckpt"
    _train(storage, 0, 50, every=10, keep=2)  # 40 and 50
    _rot(storage / step_dir(50))
    assert _statuses(storage) == {40: "complete", 50: "complete"}  # the listing cannot tell

    _train(storage, 40, 46, every=2, keep=2)  # 50 skipped and marked; commits 42, 44, 46
    assert (storage / step_dir(50) / CORRUPT_MARK).exists()  # nothing of it deleted: something to look at
    assert _statuses(storage) == {44: "complete", 46: "complete", 50: "corrupt"}  # two good ones kept

    _train(storage, 46, 50, every=2, keep=2)  # the save of step 50 replaces the rotten one
    assert _statuses(storage) == {48: "complete", 50: "complete"}
    assert _train(storage, 50, 50, every=2, keep=2) == 50  # and it loads


def test_with_keep_1_the_resume_point_survives_a_rotten_newer_checkpoint(tmp_path):
    storage = tmp_path / "ckpt"
    _train(storage, 0, 50, every=10, keep=2)
    _rot(storage / step_dir(50))
    _train(storage, 40, 46, every=2, keep=1)
    assert _statuses(storage) == {46: "complete", 50: "corrupt"}  # before: only the rotten 50 was left
    assert _train(storage, 46, 46, every=2, keep=1) == 46


def test_a_trainer_integrations_folders_mark_a_rotten_checkpoint_too(tmp_path, trainer_folder):
    """HF, Lightning, Accelerate and DeepSpeed resume from the trainer's own folders (``FolderCheckpoints``)."""
    from spotguard.integrations._folders import FolderCheckpoints

    storage = tmp_path / "ckpt"
    first = FolderCheckpoints(str(storage), keep=2, lease_ttl=None)
    first.commit(10, trainer_folder(10), "periodic")
    first.commit(20, trainer_folder(20), "periodic")
    _rot(storage / step_dir(20))
    again = FolderCheckpoints(str(storage), keep=2, lease_ttl=None)
    found = again.newest_verified()
    assert found is not None and found[0] == 10
    assert (storage / step_dir(20) / CORRUPT_MARK).exists()
    again.commit(12, trainer_folder(12), "periodic")
    assert _statuses(storage) == {10: "complete", 12: "complete", 20: "corrupt"}
