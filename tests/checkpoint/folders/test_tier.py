"""A local tier serves one run: a job of another durable storage neither resumes from it nor writes into it."""

from __future__ import annotations

import errno
import logging
import sys

import torch
import torch.distributed as dist

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.folders.tier import TIER_MARK, owner
from spotguard.ops.supervisor import Supervisor, SupervisorOptions
from spotguard.storage import LocalStorage, open_storage


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


def test_an_unmarked_tier_of_an_older_spotguard_is_claimed_only_when_its_checkpoints_are_this_runs(tmp_path, caplog):
    """A tier written before tiers were marked: this run's (every checkpoint also in its storage) is claimed;
    one holding a checkpoint the storage lacks (another run's, or unknown) is not used."""
    local = tmp_path / "nvme"
    periodic(tmp_path / "run-a", local, 4)
    (local / TIER_MARK).unlink()  # as an older spotguard left it
    with caplog.at_level(logging.WARNING):
        assert guard(tmp_path / "run-b", local).local is None
    assert "unmarked, with checkpoints of steps [4]" in caplog.text and not (local / TIER_MARK).exists()
    assert guard(tmp_path / "run-a", local).local is not None
    assert owner(open_storage(str(local))) == str(tmp_path / "run-a")


def test_a_tier_that_cannot_be_claimed_leaves_the_job_running_without_it(tmp_path, monkeypatch, caplog):
    def full(self, key, data, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStorage, "put_bytes", full)
    with caplog.at_level(logging.WARNING):
        g = guard(tmp_path / "run", tmp_path / "nvme")
    assert g.local is None and "No space left on device" in caplog.text


def test_a_sharded_run_claims_no_tier(tmp_path):
    """Sharded saves have no local tier: a process group's Guard leaves the folder to the runs that use one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = guard(tmp_path / "run", tmp_path / "nvme")
        assert g.local is None and not (tmp_path / "nvme" / TIER_MARK).exists()
        g.close()
    finally:
        dist.destroy_process_group()
