"""Saves killed mid-write (a ``step-N/`` with files and no manifest) do not stay in storage: below the
resume point the resume deletes them; above it, the first commit past them does, since a periodic
save this run skips (or never makes: another interval) would not replace them. One this run saves
again is complete and stays; one above everything this run committed stays for the next resume."""

from __future__ import annotations

import shutil
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
    target = storage / step_dir(step)
    target.mkdir()
    for f in (storage / step_dir(like)).iterdir():
        if f.name != "manifest.json":
            shutil.copy(f, target / f.name)


def test_killed_saves_go_once_the_run_is_past_them_and_saved_again_ones_stay(tmp_path):
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
    assert _train(storage, 30, every=10) == 10  # saves 20 and 30: never 13
    assert {i.step: i.status for i in scan(open_storage(str(storage)))} == {
        10: "complete",
        20: "complete",
        30: "complete",
        35: "incomplete",
    }
