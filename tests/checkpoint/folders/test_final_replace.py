"""The final save of a step already committed with other content supersedes it, never deletes it first.

A state changed after the last ``guard.step()`` (a scheduler, an EMA, ``guard.extra``) is saved at close
as the same step. The committed checkpoint of that step used to be deleted before the new files were
stored: a storage error or a kill in between left none (with ``keep=1`` no checkpoint at all).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spotguard import Guard
from spotguard.checkpoint import scan
from spotguard.errors import StorageError
from spotguard.storage.local import LocalStorage


def _run_to_10(root, keep: int = 1) -> tuple[Guard, torch.Tensor]:
    w = torch.zeros(4)
    guard = Guard(str(root), every_steps=5, keep=keep, providers=[], busy="wait")
    guard.track(w=w)
    guard.__enter__()
    guard.resume()
    for step in range(1, 11):
        w += 1
        guard.step(step)
    guard.wait()
    return guard, w


def _resumed(root) -> tuple[int | None, torch.Tensor]:
    w = torch.zeros(4)
    guard = Guard(str(root), providers=[]).track(w=w)
    step = guard.resume()
    guard.close(save=False)
    return step, w


def test_a_final_save_that_fails_to_store_leaves_the_committed_step(tmp_path, monkeypatch):
    guard, w = _run_to_10(tmp_path)
    w += 100  # changed after the last step: the final save has other content for step 10

    def failing(self, key, path, **kw):
        raise StorageError(f"injected failure storing {key}")

    monkeypatch.setattr(LocalStorage, "put_file", failing)
    with pytest.raises(StorageError):
        guard.__exit__(None, None, None)
    monkeypatch.undo()
    assert [(i.name, i.status) for i in scan(LocalStorage(str(tmp_path)))] == [("step-00000010", "complete")]
    step, resumed = _resumed(tmp_path)
    assert step == 10 and torch.equal(resumed, torch.full((4,), 10.0))  # the periodic one, as it was


def test_a_final_save_with_new_content_commits_a_revision_and_the_old_one_goes(tmp_path):
    guard, w = _run_to_10(tmp_path)
    w += 100
    guard.__exit__(None, None, None)
    assert [(i.name, i.status) for i in scan(LocalStorage(str(tmp_path)))] == [("step-00000010.r1", "complete")]
    step, resumed = _resumed(tmp_path)
    assert step == 10 and torch.equal(resumed, torch.full((4,), 110.0))

    guard, w = _run_to_10(tmp_path / "again", keep=3)  # the same content: nothing written twice
    guard.__exit__(None, None, None)
    assert [i.name for i in scan(LocalStorage(str(tmp_path / "again")))] == ["step-00000005", "step-00000010"]


def test_a_step_s_revision_is_resumed_even_when_its_clock_was_behind(tmp_path):
    # Killed between the revision's commit and the prune of the old one, which a machine whose clock ran
    # an hour ahead had committed: the revision is still the step's content.
    guard, w = _run_to_10(tmp_path)
    shutil.copytree(tmp_path / "step-00000010", tmp_path / "old")
    w += 100
    guard.__exit__(None, None, None)
    (tmp_path / "old").rename(tmp_path / "step-00000010")
    manifest = tmp_path / "step-00000010" / "manifest.json"
    data = json.loads(manifest.read_text())
    revised = json.loads((tmp_path / "step-00000010.r1" / "manifest.json").read_text())
    data["time"] = revised["time"].replace(revised["time"][:4], str(int(revised["time"][:4]) + 1), 1)
    manifest.write_text(json.dumps(data))
    assert [i.name for i in scan(LocalStorage(str(tmp_path))) if i.complete] == ["step-00000010", "step-00000010.r1"]
    step, resumed = _resumed(tmp_path)
    assert step == 10 and torch.equal(resumed, torch.full((4,), 110.0))
