"""Sharded checkpoints and the agreement, in this process with a one-rank gloo group (fast).

The multi-process behaviour (several ranks, torchrun) is in tests/guard/test_distributed.py.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spotguard import ConfigError, Guard
from spotguard.checkpoint import latest, scan
from spotguard.checkpoint.sharded.dcp import load_metadata
from spotguard.coordination.ranks import providers_for_rank
from spotguard.errors import CheckpointCorruptError, CheckpointMismatchError
from spotguard.notices.base import Notice
from spotguard.notices.file import FileProvider
from spotguard.storage import LocalStorage


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make(storage, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    guard = Guard(storage if isinstance(storage, LocalStorage) else str(storage), providers=None, **kw).track(
        model=model, optimizer=opt, scheduler=sched
    )
    return guard, model, opt, sched


def train(model, opt, sched, n):
    for _ in range(n):
        model(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_sharded_save_and_resume_restore_everything_exactly(tmp_path, group):
    guard, model, opt, sched = make(tmp_path)
    train(model, opt, sched, 3)
    manifest = guard.save(3)
    assert manifest and manifest.world_size == 1
    assert {f.name for f in manifest.files} == {"rank-00000.pt", "shards/metadata.dcp", "shards/rank-00000.distcp"}
    want = (
        {k: v.clone() for k, v in model.state_dict().items()},
        opt.state_dict(),
        sched.state_dict(),
        torch.rand(3),
    )  # the random numbers the next step would draw

    guard2, model2, opt2, sched2 = make(tmp_path)
    train(model2, opt2, sched2, 1)  # diverge first: resume must overwrite all of it
    assert guard2.resume() == 3
    got_rand = torch.rand(3)
    for k, v in want[0].items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert torch.equal(got_rand, want[3])
    assert sched2.state_dict() == want[2]
    for pid, st in want[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(opt2.state_dict()["state"][pid][k], v), (pid, k)


def test_corrupt_shard_is_skipped_for_the_previous_checkpoint(tmp_path, group, caplog):
    guard, model, opt, sched = make(tmp_path)
    train(model, opt, sched, 1)
    guard.save(1)
    train(model, opt, sched, 1)
    guard.save(2)
    shard = tmp_path / "step-00000002" / "shards" / "rank-00000.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    guard2, *_ = make(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert guard2.resume() == 1
    assert "checksum does not match the manifest" in caplog.text


def test_dcp_metadata_refuses_anything_but_its_own_classes(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "metadata.dcp"
    bad.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointCorruptError, match="not allowed"):
        load_metadata(bad)


def test_notice_stops_with_emergency_checkpoint_on_the_next_sync_step(tmp_path, group):
    guard, model, opt, sched = make(tmp_path, sync_every=3)
    assert guard.agreement is not None
    with guard:
        train(model, opt, sched, 1)
        guard.watcher.report(Notice("test", "terminate"))
        assert guard.step(1) is False and guard.step(2) is False  # not sync steps
        assert guard.step(3) is True and guard.stopped_at == 3
    info = latest(guard.storage)
    assert info and info.step == 3 and info.manifest.reason == "emergency"
    assert [i.step for i in scan(guard.storage)] == [3]  # no extra final save after the stop


def test_sharded_periodic_saves_feed_the_adaptive_interval_and_the_stats(tmp_path, group, caplog):
    caplog.set_level(logging.INFO, logger="spotguard.guard.adaptive")
    guard, model, opt, sched = make(tmp_path, every_steps=1, every_seconds="auto", mtbf_hours=6, async_save=False)
    with guard:
        train(model, opt, sched, 1)
        assert guard.step(1) is False
    assert [i.step for i in scan(guard.storage)] == [1]  # the periodic save; the final one is not repeated
    assert "checkpoint interval 600s ->" in caplog.text  # re-picked from the measured (tiny) cost
    record = guard.stats().as_dict()
    assert record["checkpoints"] == 1 and record["write_s"] > 0
    assert record["async"] is False  # sharded saves are synchronous: the write is what stalls the loop


def test_providers_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SPOTGUARD_NOTICE_FILE", str(tmp_path / "notice-{rank}"))
    chosen = providers_for_rank("signal,file,aws")
    assert chosen[0] == "signal" and len(chosen) == 2  # cloud metadata: local rank 0 only
    assert isinstance(chosen[1], FileProvider) and chosen[1].path == tmp_path / "notice-3"
    assert providers_for_rank("signal,aws", poll_on="all") == ["signal", "aws"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert providers_for_rank("signal,aws") == ["signal", "aws"]


def test_single_process_without_torchrun_is_untouched(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert providers_for_rank("auto") == "auto"


@pytest.mark.parametrize("kw", [{"sync_every": 0}, {"reshard": "merge"}, {"poll_on": "rank-7"}])
def test_bad_distributed_options_are_refused(tmp_path, kw):
    with pytest.raises(ConfigError):
        Guard(str(tmp_path), providers=None, **kw)


def test_single_process_refuses_a_sharded_checkpoint_instead_of_skipping_it(tmp_path, group):
    guard, model, opt, sched = make(tmp_path)
    guard.save(1)
    dist.destroy_process_group()
    try:
        alone, *_ = make(tmp_path)
        assert alone.agreement is None
        with pytest.raises(CheckpointMismatchError, match="sharded checkpoint of 1 rank.*torchrun"):
            alone.resume()
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class GatedStorage(LocalStorage):
    """Local storage whose writes of one rank file wait for ``gate`` (to hold a background save in flight)."""

    def __init__(self, url: str, key: str = "step-00000001/rank-00000.pt") -> None:
        super().__init__(url)
        self.key, self.gate, self.writing = key, threading.Event(), threading.Event()

    def put_file(self, key, path, *, deadline=None, crc=None):
        if key == self.key:
            self.writing.set()
            assert self.gate.wait(20), "test never opened the gate"
        return super().put_file(key, path, deadline=deadline, crc=crc)


def test_sharded_saves_are_synchronous_with_async_sharded_false(tmp_path, group):
    guard, *_ = make(tmp_path, every_steps=1, async_sharded=False)
    assert guard.agreement.store is None and guard.stats().as_dict()["async"] is False
    guard.step(1)
    assert guard.saves.pending is None and latest(guard.storage).step == 1  # committed before step() returned
    guard.close(save=False)


def test_async_sharded_save_returns_before_the_write_and_writes_the_snapshot(tmp_path, group):
    storage = GatedStorage(str(tmp_path))
    guard, model, opt, sched = make(storage, every_steps=1, busy="skip", save_on_exit=False, async_sharded=True)
    assert guard.agreement.store is not None
    with guard:
        train(model, opt, sched, 1)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        assert guard.step(1) is False  # returns although the write is held
        assert storage.writing.wait(10) and latest(guard.storage) is None
        train(model, opt, sched, 1)  # training moves on while step 1 is written
        assert guard.step(2) is False and guard.stats().skipped == 1  # busy: skipped, not queued
        storage.gate.set()
        guard.wait()
        assert guard.stats().as_dict()["async"] is True and guard.stats().snapshot_s is not None
    assert [i.step for i in scan(guard.storage)] == [1]
    assert guard.agreement.group is None  # the Guard's groups went with the block
    assert not [t for t in threading.enumerate() if t.name.startswith("spotguard-save")]
    fresh, model2, *_ = make(tmp_path)
    assert fresh.resume() == 1
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k  # the state at step 1, not the one trained after


def test_a_background_sharded_save_over_the_staging_budget_is_written_now_and_resumes_exactly(tmp_path, group, caplog):
    """A rank's share larger than its staging budget (``staging_budget``): nothing is copied into host
    buffers; the rank writes its share before ``step()`` returns, from the live state, streamed, as the
    single engine does; one WARNING says so. It commits and resumes like any other."""
    guard, model, opt, sched = make(tmp_path, every_steps=1, async_sharded=True, staging_budget=64)
    with guard:
        train(model, opt, sched, 1)
        with caplog.at_level(logging.WARNING, logger="spotguard"):
            guard.step(1)
        assert guard.last_saved is not None and guard.last_saved.step == 1  # committed before step() returned
        stats = guard.stats()
        assert guard.saves.engine.staged_bytes == 0 and stats.staging_budget == 64
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert sum("larger than the staging budget" in r.getMessage() for r in caplog.records) == 1
    guard2, model2, *_ = make(tmp_path)
    assert guard2.resume() == 1
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k
    guard2.close()


def test_emergency_abandons_an_inflight_async_sharded_save_and_commits_the_newest(tmp_path, group, caplog):
    caplog.set_level(logging.INFO, logger="spotguard")
    storage = GatedStorage(str(tmp_path))
    guard, model, opt, sched = make(storage, every_steps=1, async_sharded=True)
    with guard:
        train(model, opt, sched, 1)
        guard.step(1)
        assert storage.writing.wait(10)
        guard.watcher.report(Notice("test", "terminate"))  # nothing measured yet: the newer state wins
        threading.Timer(0.3, storage.gate.set).start()
        assert guard.step(2) is True
    assert [(i.step, i.manifest.reason) for i in scan(guard.storage) if i.complete] == [(2, "emergency")]
    assert "abandoning the save of step 1" in caplog.text and "emergency checkpoint of step 2 committed" in caplog.text
    assert not (tmp_path / "step-00000001" / "manifest.json").exists()  # the cancel reached the commit


def test_emergency_that_cannot_make_the_deadline_keeps_the_inflight_async_sharded_save(tmp_path, group, caplog):
    import datetime as dt

    storage = GatedStorage(str(tmp_path))
    guard, model, opt, sched = make(storage, every_steps=1, save_on_exit=False, async_sharded=True)
    guard.stats().write_Bps, guard.stats().state_bytes = 1.0, 10_000  # measured: far too slow for the state
    with guard:
        guard.step(1)
        assert storage.writing.wait(10)
        deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3)
        guard.watcher.report(Notice("test", "terminate", deadline=deadline))
        threading.Timer(0.3, storage.gate.set).start()
        assert guard.step(3) is True
    assert [(i.step, i.manifest.reason) for i in scan(guard.storage) if i.complete] == [(1, "periodic")]
    assert "2 step(s) will be lost" in caplog.text


def test_a_sharded_emergency_save_leaves_pruning_to_the_next_save(tmp_path, group):
    guard, model, opt, sched = make(tmp_path, keep=1, async_sharded=False)
    train(model, opt, sched, 1)
    guard.save(1)
    guard.watcher.report(Notice("test", "terminate"))
    with guard:
        train(model, opt, sched, 1)
        assert guard.step(2) is True
    assert [(i.step, i.manifest.reason) for i in scan(LocalStorage(str(tmp_path))) if i.complete] == [
        (1, "manual"),
        (2, "emergency"),
    ]  # keep=1, and step 1 is still there: nothing but the commit ran on the deadline's clock
    assert guard.stats().sync_Bps is not None  # a synchronous save's own rate, for the next estimate


def test_a_sharded_guard_that_lost_its_lease_commits_nothing(tmp_path, group):
    """Rank 0's engine was handed the lease's fence (no table of leased storages finds it)."""
    import time

    from spotguard.checkpoint.lease import LEASE, LeaseRecord
    from spotguard.errors import LeaseLostError

    guard, model, opt, sched = make(tmp_path, lease_ttl=30)
    assert guard.save(1) is not None  # holds the lease, fenced and committed
    now = time.time()
    other = LeaseRecord("run-b", "other-host", 4242, now, now, 30.0, owner="b" * 16)
    _, token = guard.storage.get_versioned(LEASE)
    guard.storage.put_conditional(LEASE, other.to_bytes(), token=token)  # another job took the run over
    train(model, opt, sched, 1)
    with pytest.raises(LeaseLostError, match="other-host"):
        guard.save(2)
    assert [i.step for i in scan(guard.storage) if i.complete] == [1]
    guard.close()


@pytest.mark.slow
def test_under_ddp_each_rank_stages_only_the_replicated_items_it_writes_and_both_resume_exactly(tmp_path):
    """Two gloo processes, a DDP model and AdamW, one background save: DCP's plan gives each replicated
    item to one rank, so the two ranks' staged bytes add up to one copy of the state, not two."""
    import sys

    from tests.helpers import WORKERS, run_ranks, worker_results

    root = tmp_path / "ckpt"
    done = run_ranks([sys.executable, str(WORKERS / "dist_staged_share.py"), str(root), str(tmp_path)], timeout=120)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    lines = worker_results(tmp_path)
    saves = {r["rank"]: r for r in lines if "staged" in r}
    resumes = {r["rank"]: r for r in lines if "resumed" in r}
    whole = saves[0]["whole"]
    assert saves[1]["whole"] == whole > 0
    assert saves[0]["staged"] + saves[1]["staged"] == whole, saves  # each item copied once, by its writer
    assert 0 < saves[1]["staged"] < whole, saves
    assert all(s["checkpoints"] >= 1 and s["work_Bps"] for s in saves.values()), saves  # the commit's own work
    assert all(s["allocations"] == 0 and s["alloc_s"] is not None for s in saves.values()), saves  # reserved
    assert resumes[0] == {"rank": 0, "resumed": 2, "exact": True} and resumes[1]["exact"], resumes
