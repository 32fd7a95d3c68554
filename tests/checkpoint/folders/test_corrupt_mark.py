"""A checkpoint that a resume finds unlike its manifest (bit rot at the same size) stops counting as one.

Its listing still looked committed, so retention counted it among the ``keep``, the newest too: with
``keep=2`` the resumed run kept one good checkpoint, with ``keep=1`` none (each commit pruned at once,
the resume point too), and a save of its step was refused as already committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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


def test_a_mismatch_a_second_read_does_not_repeat_is_not_marked(tmp_path, caplog):
    """A download garbled on its way (or a flaky disk read) says nothing of the stored bytes: only a
    mismatch that a fresh read confirms marks the checkpoint."""
    from spotguard.storage.local import LocalStorage

    class GarbledOnce(LocalStorage):
        garbled = False

        def local_copy(self, key):
            if key.endswith("/state.pt") and not self.garbled:
                type(self).garbled = True
                path = tmp_path / "garbled.pt"
                data = bytearray((self.root / key).read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
                return contextlib.nullcontext(path)
            return super().local_copy(key)

    storage = tmp_path / "ckpt"
    _train(storage, 0, 20, every=10, keep=2)
    guard = Guard(GarbledOnce(str(storage)), providers=[])
    guard.track(model=torch.nn.Linear(8, 8))
    assert guard.resume() == 10  # this run skipped 20, as it must: its copy did not verify
    guard.close(save=False)
    assert "not marked corrupt: read again, it matched its manifest" in caplog.text
    assert _statuses(storage) == {10: "complete", 20: "complete"}


def test_a_file_of_the_checkpoint_named_like_the_mark_is_no_mark(tmp_path, trainer_folder):
    from spotguard.integrations._folders import FolderCheckpoints

    folder = trainer_folder(10)
    (folder / CORRUPT_MARK).write_text("{}")  # a trainer's own file of that name
    FolderCheckpoints(str(tmp_path / "ckpt"), keep=2, lease_ttl=None).commit(10, folder, "periodic")
    assert _statuses(tmp_path / "ckpt") == {10: "complete"}


def test_a_final_save_replaces_a_marked_revision_even_with_the_same_content(tmp_path, caplog):
    """Step 10's newest revision (``step-N.r1``) is marked corrupt; the final save, of the very content it
    had, replaces it rather than report "already committed" and leave no good checkpoint of the step."""
    storage = tmp_path / "ckpt"
    _train(storage, 0, 10, every=10, keep=2)  # step 10
    model = torch.nn.Linear(8, 8)
    with Guard(str(storage), providers=[], keep=2).track(model=model) as guard:
        assert guard.resume() == 10
        model.weight.data.add_(1.0)  # changed after the step: the final save supersedes it as r1
        guard.step(10)
    assert (storage / "step-00000010.r1").is_dir() and not (storage / step_dir(10)).exists()
    guard = Guard(str(storage), providers=[], keep=2).track(model=torch.nn.Linear(8, 8))
    assert guard.resume() == 10  # r1's content
    _rot(storage / "step-00000010.r1")
    (storage / "step-00000010.r1" / CORRUPT_MARK).write_text("{}")
    with guard:
        guard.step(10)  # the same content again
    assert "already committed" not in caplog.text
    assert _statuses(storage) == {10: "complete"}
    assert _train(storage, 10, 10, every=10, keep=2) == 10


def test_a_newer_checkpoint_that_verifies_but_does_not_load_here_holds_no_place_among_the_keep(
    tmp_path, engine, monkeypatch
):
    """One that matches its manifest but does not load on this machine (a newer torch wrote it, a passing
    fault) is skipped and not marked: it may load elsewhere. Counted among the ``keep`` as the newest, it
    had every checkpoint the resumed run wrote below it pruned at once with ``keep=1``, its resume point too."""
    storage = tmp_path / "ckpt"
    _train(storage, 0, 50, every=10, keep=2)  # 40 and 50
    real_load = torch.load

    def load(f, *args, **kwargs):
        if step_dir(50) in str(f):
            raise RuntimeError("Unsupported operand 118: written by a newer torch")
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    guard = Guard(str(storage), providers=[], keep=1, save_on_exit=False).track(model=torch.nn.Linear(8, 8))
    assert guard.resume() == 40
    assert guard.saves.durable_step == 40  # the resume point, not the newer one that did not load
    guard.close(save=False)
    _train(storage, 40, 46, every=2, keep=1)  # 50 skipped again; commits 42, 44, 46
    assert _statuses(storage) == {46: "complete", 50: "complete"}  # before: only 50 was left
    assert _train(storage, 46, 46, every=2, keep=1) == 46
    monkeypatch.undo()
    assert _train(storage, 50, 50, every=2, keep=1) == 50  # where it loads, it is the newest


def test_a_fresh_start_beside_checkpoints_that_do_not_load_keeps_its_own(tmp_path, engine, monkeypatch):
    """``on_unloadable="fresh"``: the new run's checkpoints are below the old ones, which counted among the
    ``keep`` as the newest: every commit of the new run was pruned at once, and each restart began at 0."""
    storage = tmp_path / "ckpt"
    _train(storage, 0, 50, every=10, keep=2)  # 40 and 50
    real_load = torch.load

    def load(f, *args, **kwargs):
        if any(f"{step_dir(s)}/" in str(f) for s in (40, 50)):  # not their revisions (step-N.r1/)
            raise RuntimeError("Unsupported operand 118: written by a newer torch")
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)

    def run(start_at: int, steps: int, every: int = 2, then: Callable[[Guard], None] = lambda guard: None) -> None:
        model = torch.nn.Linear(8, 8)
        guard = Guard(
            str(storage),
            providers=[],
            every_steps=every,
            keep=1,
            on_unloadable="fresh",
            busy="wait",
            save_on_exit=False,
        )
        guard.track(model=model)
        assert guard.resume() == start_at
        with guard:
            for step in range(start_at, steps):
                guard.step(step + 1)
            then(guard)

    def emergency_then_final(guard: Guard) -> None:  # synchronous saves of 50 (the sharded engine's ``_write``)
        assert guard.save(50, "emergency") is not None
        assert (storage / "step-00000050.r1").is_dir() and (storage / step_dir(50)).is_dir()  # the next save prunes
        assert guard.save(50, "final") is None  # this run's own checkpoint of 50: committed, not written twice

    run(0, 6)
    assert _statuses(storage) == {6: "complete", 40: "complete", 50: "complete"}  # before: {40, 50}
    run(6, 8)  # a restart resumes the new run
    assert _statuses(storage) == {8: "complete", 40: "complete", 50: "complete"}
    # A save of the old one's step supersedes it; before, it was refused as "already committed": nothing saved
    # (the sharded engine's emergency save too), the run had no checkpoint between 8 and 50.
    run(8, 40)  # a background save of 40
    assert (storage / "step-00000040.r1").is_dir() and _statuses(storage) == {40: "complete", 50: "complete"}
    assert not (storage / step_dir(40)).exists()  # superseded, pruned once its successor landed
    run(40, 50, every=1000, then=emergency_then_final)  # a restart (it loads 40.r1: 50 does not load)
    run(50, 52)
    assert _statuses(storage) == {52: "complete"}
