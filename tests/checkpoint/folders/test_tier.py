"""A local tier serves one run: a job of another durable storage neither resumes from it nor writes into it."""

from __future__ import annotations

import logging
import sys

import torch

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.folders.tier import TIER_MARK, owner
from spotguard.ops.supervisor import Supervisor, SupervisorOptions
from spotguard.storage import open_storage


def guard(durable, local) -> spotguard.Guard:
    return spotguard.Guard(str(durable), providers=[], local_dir=str(local)).track(model=torch.nn.Linear(2, 2))


def periodic(durable, local, step: int) -> None:
    """A periodic checkpoint of ``step``, in the local tier first, then in ``durable``."""
    g = spotguard.Guard(
        str(durable), providers=[], every_steps=step, busy="wait", local_dir=str(local), save_on_exit=False
    ).track(model=torch.nn.Linear(2, 2))
    with g:
        for s in range(1, step + 1):
            g.step(s)
        g.wait()


def steps(url) -> list[int]:
    return [i.step for i in checkpoint.scan(open_storage(str(url))) if i.complete]


def test_a_new_run_neither_resumes_nor_overwrites_another_runs_local_tier(tmp_path, caplog):
    """One $SPOTGUARD_LOCAL_DIR for every job of a machine: run B started on it after run A must start at
    step 0 from its own empty storage, not from A's newest local checkpoint (written into B's storage)."""
    local = tmp_path / "nvme"
    periodic(tmp_path / "run-a", local, 150)
    assert steps(local) == [150] and owner(open_storage(str(local))) == str(tmp_path / "run-a")
    with caplog.at_level(logging.WARNING):
        other = guard(tmp_path / "run-b", local)
    assert other.local is None and "it holds the checkpoints of another run" in caplog.text
    assert str(tmp_path / "run-a") in caplog.text
    assert other.resume() == 0
    other.save(5, "periodic")
    assert steps(tmp_path / "run-b") == [5] and steps(local) == [150]  # A's tier untouched


def test_the_same_run_named_by_a_relative_path_keeps_its_tier(tmp_path, monkeypatch):
    local = tmp_path / "nvme"
    periodic(tmp_path / "run", local, 3)
    assert steps(local) == [3]
    monkeypatch.chdir(tmp_path)
    again = guard("run", local)
    checkpoint.delete(open_storage(str(tmp_path / "run")), "step-00000003")  # the local copy alone resumes
    assert again.local is not None and again.resume() == 3


def test_an_unreadable_tier_mark_leaves_the_tier_unused(tmp_path, caplog):
    local = tmp_path / "nvme"
    local.mkdir()
    (local / TIER_MARK).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        g = guard(tmp_path / "run", local)
    assert g.local is None and "unreadable" in caplog.text
    g.save(1, "periodic")
    assert steps(tmp_path / "run") == [1] and (local / TIER_MARK).read_text() == "{not json"


def test_the_supervisor_prefetches_into_its_runs_tier_only(tmp_path):
    local = tmp_path / "nvme"
    periodic(tmp_path / "run-a", local, 9)
    spotguard.Guard(str(tmp_path / "run-b"), providers=[]).track(model=torch.nn.Linear(2, 2)).save(4, "periodic")
    job = [sys.executable, "-c", "pass"]
    assert (
        Supervisor(SupervisorOptions(job, storage=str(tmp_path / "run-b"), local_dir=str(local), prefetch=True)).run()
        == 0
    )
    assert steps(local) == [9]  # run B's step 4 not copied into run A's tier
