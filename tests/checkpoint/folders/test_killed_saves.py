"""Saves killed mid-write (a ``step-N/`` with files and no manifest) do not stay in storage: below the
resume point the resume deletes them; above it, the first commit past them does, since a periodic
save this run skips (or never makes: another interval) would not replace them. One this run saves
again is complete and stays; one above everything this run committed stays for the next resume. The
same in a process group (the sharded engine, rank 0 tidying), here a one-rank gloo group."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import torch

from spotguard import Guard
from spotguard.checkpoint import scan
from spotguard.checkpoint.format.manifest import step_dir
from spotguard.storage import open_storage


def _train(storage: Path, steps: int, every: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    guard = Guard(str(storage), providers=[], every_steps=every, keep=10)
    guard.track(model=model)
    start = guard.resume()
    with guard:
        for step in range(start, steps):
            model.weight.data.add_(0.01)
            guard.step(step + 1)
    return start


def _killed_save(storage: Path, step: int, like: int) -> None:
    """What a writer killed before its manifest leaves: the files of a step, no manifest."""
    shutil.copytree(storage / step_dir(like), storage / step_dir(step))
    (storage / step_dir(step) / "manifest.json").unlink()


def test_killed_saves_go_once_the_run_is_past_them_and_saved_again_ones_stay(tmp_path, engine):
    storage = tmp_path / "ckpt"
    _train(storage, 10, every=10)
    for step in (5, 13, 20, 35):  # below the resume point, skipped over, saved again, above everything
        _killed_save(storage, step, like=10)
    assert {i.step: i.status for i in scan(open_storage(str(storage)))} == {
        5: "incomplete",
        10: "complete",
        13: "incomplete",
        20: "incomplete",
        35: "incomplete",
    }
    sharded = (storage / step_dir(10) / "shards").is_dir()
    assert sharded == (engine == "sharded")
    assert _train(storage, 30, every=10) == 10  # saves 20 and 30: never 13
    assert {i.step: i.status for i in scan(open_storage(str(storage)))} == {
        10: "complete",
        20: "complete",
        30: "complete",
        35: "incomplete",
    }


def test_a_trainer_integrations_folders_lose_killed_saves_the_same_way(tmp_path, trainer_folder):
    """HF, Lightning, Accelerate and DeepSpeed commit the trainer's own folders (``FolderCheckpoints``)."""
    from spotguard.integrations._folders import FolderCheckpoints

    storage = tmp_path / "ckpt"
    first = FolderCheckpoints(str(storage), keep=10, lease_ttl=None)
    first.commit(10, trainer_folder(10), "periodic")
    for step in (5, 13, 20, 35):
        _killed_save(storage, step, like=10)
    again = FolderCheckpoints(str(storage), keep=10, lease_ttl=None)
    found = again.newest_verified()
    assert found is not None and found[0] == 10
    assert {i.step for i in scan(open_storage(str(storage)))} == {10, 13, 20, 35}  # 5: below the resume point
    again.commit(20, trainer_folder(20), "periodic")
    again.commit(30, trainer_folder(30), "emergency")  # no housekeeping on the deadline's clock
    assert {i.step: i.status for i in scan(open_storage(str(storage)))} == {
        10: "complete",
        20: "complete",
        30: "complete",
        35: "incomplete",
    }


def test_a_save_of_a_killed_step_still_writing_is_not_taken_for_its_leftovers(tmp_path, engine):
    """A resume remembered the killed ``step-20/``; this run's background save of 20 is writing that folder
    again when a manual save of 21 commits: the commit's housekeeping must leave 20 to its writer."""
    storage = tmp_path / "ckpt"
    _train(storage, 10, every=10)
    _killed_save(storage, 20, like=10)
    model = torch.nn.Linear(8, 8)
    guard = Guard(str(storage), providers=[], every_steps=10, keep=10, async_save=True, save_on_exit=False)
    guard.track(model=model)
    assert guard.resume() == 10
    reached, gate, real = threading.Event(), threading.Event(), guard.storage.put_bytes

    def held(key, data, **kw):  # the save of 20 has written its files, not yet its manifest
        if key.startswith(f"{step_dir(20)}/") and key.endswith("manifest.json"):
            reached.set()
            assert gate.wait(30)
        return real(key, data, **kw)

    guard.storage.put_bytes = held
    with guard:
        guard.step(20)  # due: staged, written in the background, held before its commit
        assert reached.wait(30)
        guard.save(21)  # commits at once, then tidies
        gate.set()
    infos = {i.step: i for i in scan(open_storage(str(storage)))}
    assert infos[20].complete and infos[21].complete, {s: (i.status, i.problem) for s, i in infos.items()}


def test_a_killed_revision_of_the_resume_step_goes_and_one_committed_since_the_listing_stays(tmp_path):
    """A revision of the resumed step killed mid-write (``step-N.r1/`` without a manifest) is neither below
    nor above the resume point, and nothing will replace it; a folder whose manifest landed after the
    listing is a checkpoint, whatever the listing said."""
    from spotguard.checkpoint.folders.retention import Housekeeping

    storage = tmp_path / "ckpt"
    _train(storage, 10, every=10)
    shutil.copytree(storage / step_dir(10), storage / step_dir(10, 1))
    (storage / step_dir(10, 1) / "manifest.json").unlink()
    _killed_save(storage, 5, like=10)
    store = open_storage(str(storage))
    listed = scan(store)
    assert {(i.name, i.status) for i in listed} >= {(step_dir(10, 1), "incomplete"), (step_dir(5), "incomplete")}
    shutil.copy(storage / step_dir(10) / "manifest.json", storage / step_dir(5) / "manifest.json")  # landed since
    Housekeeping(keep=10).at_resume([(store, listed)], 10)
    assert not (storage / step_dir(10, 1)).exists()
    assert (storage / step_dir(5) / "manifest.json").exists() and len(list((storage / step_dir(5)).iterdir())) > 1


def test_a_folder_marker_key_in_a_killed_save_is_left_with_a_warning_and_the_resume_goes_on(tmp_path, caplog):
    """S3 and GCS consoles make a ``step-N/`` "folder" object (``step-N//x`` happens too): a key no storage
    call takes (``check_key``). Its ``ConfigError`` failed every resume for good (a permanent error), and a
    save of that step (its leftovers cleared first) too."""
    from spotguard.storage.local import LocalStorage

    markers = ("step-00000015/", "step-00000030/")

    class ObjectStoreLike(LocalStorage):
        def list_sizes(self, prefix=""):
            sizes = super().list_sizes(prefix)
            for marker in markers:
                if marker.startswith(prefix) or prefix.startswith(marker):
                    sizes[marker] = 0  # as an object store lists a console's folder marker
            return sizes

    storage = tmp_path / "ckpt"
    _train(storage, 20, every=10)
    _killed_save(storage, 15, like=10)  # below the resume point: removed at the resume
    _killed_save(storage, 30, like=10)  # above it: replaced by the save of step 30
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    guard = Guard(ObjectStoreLike(str(storage)), providers=[], every_steps=10, busy="wait")
    guard.track(model=model)
    assert guard.resume() == 20
    with guard:
        for step in range(20, 30):
            guard.step(step + 1)
    assert not (storage / step_dir(15)).exists()  # the rest of the killed save went
    assert {i.step: i.status for i in scan(open_storage(str(storage)))} == {
        10: "complete",
        20: "complete",
        30: "complete",
    }
    assert "does not delete keys with an empty component ('step-00000015/')" in caplog.text
