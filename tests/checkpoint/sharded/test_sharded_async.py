"""Background sharded saves coordinate through the job's store: two ranks as two threads on one HashStore.

No process group is needed: the background path uses none, which is the point (a destroyed group
cannot block it). Each case checks that every rank ends, with the same verdict, and what is on disk.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spotguard.checkpoint import scan
from spotguard.checkpoint.engine import Tracked
from spotguard.checkpoint.format.manifest import MANIFEST
from spotguard.checkpoint.sharded import sharded_async
from spotguard.checkpoint.sharded.sharded import ShardedEngine
from spotguard.errors import SaveCancelled, StorageError
from spotguard.storage import LocalStorage


def ranks(storage, store=None, world=2, timeout=30.0, step=1, stores=None, resumed_beside=None):
    """One engine per rank, each with the state staged for ``step``; returns (engines, works, commits).
    ``stores``: each rank's own client of the store (default: ``store``, shared). The ranks stage at
    once, each in a thread of its own, as every rank's loop does: they agree on DCP's plan as they stage.
    ``resumed_beside``: the listing of a resume at which none loaded (``sharded_load`` on every rank)."""
    store = store or dist.HashStore()
    stores = stores or [store] * world
    commits: dict[int, list] = {r: [] for r in range(world)}
    engines, models = [], []
    for r in range(world):
        groups = SimpleNamespace(rank=r, world_size=world, store=stores[r], uid="t", timeout_s=timeout, save_group=None)
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        engines.append(ShardedEngine(storage, groups, keep=3, on_commit=commits[r].append))
        if resumed_beside is not None:
            engines[-1]._tidy.supersede(resumed_beside, 0)
    works: list = [None] * world

    def stage(r):
        works[r] = engines[r].stage(Tracked({"model": models[r]}, {}), step, "periodic")

    threads = [threading.Thread(target=stage, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(w is not None for w in works), "a rank never staged"
    return engines, works, commits


def run(works, cancels=None, only=None):
    """Run each rank's work in its own thread; returns {rank: result or exception} and the seconds taken."""
    cancels = cancels or [threading.Event() for _ in works]
    out: dict[int, object] = {}

    def one(r):
        try:
            works[r](cancels[r])
            out[r] = "ok"
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(works)) if only is None or r in only]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank never ended"
    return out, time.monotonic() - t0


def test_two_ranks_commit_one_checkpoint_and_leave_no_keys(tmp_path):
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    _, works, commits = ranks(storage, store)
    out, _ = run(works)
    assert out == {0: "ok", 1: "ok"}
    assert [len(c) for c in commits.values()] == [1, 1] and commits[0][0].manifest == commits[1][0].manifest
    names = {f.name for f in commits[0][0].manifest.files}
    assert names == {
        "rank-00000.pt",
        "rank-00001.pt",
        "shards/metadata.dcp",
        "shards/rank-00000.distcp",
        "shards/rank-00001.distcp",
    }
    assert [i.status for i in scan(storage)] == ["complete"]
    assert store.num_keys() == 0  # rank 0 forgot the save's keys once both had read the outcome


def test_two_ranks_supersede_a_checkpoint_of_their_step_that_did_not_load(tmp_path):
    """After a fresh start beside a committed checkpoint of step 1 that did not load, both ranks write their
    files into its next revision and rank 0 commits it there; the old one is pruned once superseded. Before,
    the save was refused as "already committed" and nothing of the new run's step 1 was written."""
    storage = LocalStorage(str(tmp_path))
    assert run(ranks(storage)[1])[0] == {0: "ok", 1: "ok"}
    _, works, commits = ranks(storage, resumed_beside=scan(storage))
    assert run(works)[0] == {0: "ok", 1: "ok"}
    assert [len(c) for c in commits.values()] == [1, 1] and commits[0][0].manifest == commits[1][0].manifest
    written = {str(p.relative_to(tmp_path / "step-00000001.r1")) for p in (tmp_path / "step-00000001.r1").rglob("*")}
    assert {f.name for f in commits[0][0].manifest.files} | {MANIFEST, "shards"} == written  # both ranks' files
    assert [(i.name, i.status) for i in scan(storage)] == [("step-00000001.r1", "complete")]


class FailingRank(LocalStorage):
    """Rank 1's file cannot be written."""

    def put_file(self, key, path, *, deadline=None, crc=None):
        if key.endswith("rank-00001.pt"):
            raise OSError("disk full")
        return super().put_file(key, path, deadline=deadline, crc=crc)


def test_a_failure_on_one_rank_fails_the_save_on_both_with_its_reason(tmp_path):
    storage = FailingRank(str(tmp_path))
    _, works, commits = ranks(storage)
    out, _ = run(works)
    for r in (0, 1):
        assert isinstance(out[r], StorageError), out
        assert "rank 1" in str(out[r]) and "disk full" in str(out[r])
    assert commits == {0: [], 1: []} and [i.status for i in scan(storage)] == ["incomplete"]


class HeldShard(LocalStorage):
    """Rank 0's shard write waits until released: the save stays in flight."""

    def __init__(self, url):
        super().__init__(url)
        self.writing, self.release = threading.Event(), threading.Event()

    def put_file(self, key, path, *, deadline=None, crc=None):
        if key.endswith("shards/rank-00000.distcp"):
            self.writing.set()
            self.release.wait(20)
        return super().put_file(key, path, deadline=deadline, crc=crc)


def test_a_cancel_ends_the_save_on_every_rank_and_commits_nothing(tmp_path):
    storage = HeldShard(str(tmp_path))
    _, works, commits = ranks(storage)
    cancels = [threading.Event(), threading.Event()]

    def abandon():  # the emergency's decision, taken on every rank (rank 1 waits for rank 0's outcome)
        assert storage.writing.wait(20)
        for c in cancels:
            c.set()
        storage.release.set()

    threading.Thread(target=abandon).start()
    out, _ = run(works, cancels)
    assert all(isinstance(out[r], SaveCancelled) for r in (0, 1)), out
    assert commits == {0: [], 1: []}
    assert not any(i.complete for i in scan(storage))


def test_a_cancelled_rank_releases_a_peer_that_waits_for_it(tmp_path):
    storage = LocalStorage(str(tmp_path))
    _, works, _ = ranks(storage)
    cancels = [threading.Event(), threading.Event()]
    cancels[1].set()  # rank 1 was told to drop the save before it began
    out, seconds = run(works, cancels)
    assert all(isinstance(out[r], SaveCancelled) for r in (0, 1)), out
    assert seconds < 10  # rank 0 learnt it from rank 1's keys, not from a timeout
    assert not any(i.complete for i in scan(storage))


def test_a_peer_that_never_reports_fails_the_save_after_the_timeout(tmp_path):
    storage = LocalStorage(str(tmp_path))
    _, works, commits = ranks(storage, timeout=0.5)
    out, seconds = run(works, only={0})  # rank 1's process is gone
    assert isinstance(out[0], StorageError) and "within" in str(out[0]), out
    assert seconds < 10 and commits[0] == []


def test_a_step_already_committed_is_not_written_twice(tmp_path):
    storage = LocalStorage(str(tmp_path))
    _, works, _ = ranks(storage)
    assert run(works)[0] == {0: "ok", 1: "ok"}
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "step-00000001").rglob("*")}
    _, works, commits = ranks(storage)
    assert run(works)[0] == {0: "ok", 1: "ok"}
    assert commits == {0: [], 1: []}
    assert {f.name: f.stat().st_mtime_ns for f in (tmp_path / "step-00000001").rglob("*")} == before


@pytest.mark.parametrize("world", [1, 3])
def test_any_world_size(tmp_path, world):
    storage = LocalStorage(str(tmp_path))
    _, works, commits = ranks(storage, world=world)
    assert run(works)[0] == dict.fromkeys(range(world), "ok")
    assert sum(f.name.startswith("rank-") for f in commits[0][0].manifest.files) == world


def test_no_keys_are_left_behind_by_a_failed_a_cancelled_or_an_existing_save(tmp_path):
    """Thousands of saves share the job's store (held in memory by torchrun's agent): a save that does
    not commit forgets its keys too, once every rank is done with them."""
    store = dist.HashStore()
    _, works, _ = ranks(FailingRank(str(tmp_path / "failed")), store)
    out, _ = run(works)
    assert all(isinstance(out[r], StorageError) for r in (0, 1)), out
    assert store.num_keys() == 0
    _, works, _ = ranks(LocalStorage(str(tmp_path / "cancelled")), store)
    cancels = [threading.Event(), threading.Event()]
    cancels[1].set()
    out, _ = run(works, cancels)
    assert all(isinstance(out[r], SaveCancelled) for r in (0, 1)), out
    assert store.num_keys() == 0
    storage = LocalStorage(str(tmp_path / "exists"))
    for _ in range(2):  # the second finds the step committed
        _, works, _ = ranks(storage, store)
        assert run(works)[0] == {0: "ok", 1: "ok"}
        assert store.num_keys() == 0


class CommitHook(LocalStorage):
    """Calls ``before_commit()`` as rank 0 writes the manifest."""

    def __init__(self, url, before_commit):
        super().__init__(url)
        self.before_commit = before_commit

    def put_bytes(self, key, data, **kwargs):
        if key.endswith(MANIFEST):
            self.before_commit()
        return super().put_bytes(key, data, **kwargs)


def test_a_rank_whose_store_client_is_busy_when_the_outcome_lands_still_reads_it(tmp_path, monkeypatch):
    """A TCPStore client runs one request at a time: while the loop's thread waits in a blocking store
    call (a process group or NCCL communicator being set up, waiting for a slower rank 0), the
    writer's polls on that rank wait behind it. Rank 0 must not forget the outcome before that rank
    read it: that rank would wait out the timeout (30 min) for a save that committed, then call it
    failed while rank 0 calls it committed."""
    monkeypatch.setattr(sharded_async, "READ_GRACE_S", 0.3)
    hold = 2.0  # > READ_GRACE_S: rank 1 reads the outcome late
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=hold))
    busy = threading.Event()

    def rendezvous():  # rank 1's loop thread: a blocking get of a key nobody sets, until the client's timeout
        busy.set()
        try:
            client.get("rendezvous/never")
        except Exception:
            pass

    def before_commit():  # the outcome lands while rank 1's client is busy
        threading.Thread(target=rendezvous, daemon=True).start()
        busy.wait(5)
        time.sleep(0.2)

    storage = CommitHook(str(tmp_path), before_commit)
    _, works, commits = ranks(storage, stores=[server, client], timeout=6.0)
    out, _ = run(works)
    assert out == {0: "ok", 1: "ok"}, out
    assert [len(c) for c in commits.values()] == [1, 1]
    assert not server.check(["t/1/outcome"])  # forgotten once both had read it


def test_a_job_that_rendezvoused_through_a_file_saves_synchronously(tmp_path):
    """A FileStore only grows (deletes append tombstones): background saves would bloat it forever."""
    from spotguard.coordination.agreement import setup

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        groups = setup(1, async_save=True)
        assert groups is not None and groups.store is None
        groups.close()
    finally:
        dist.destroy_process_group()


def test_the_writer_gets_a_store_client_of_its_own(tmp_path):
    """One TCPStore client serves one request at a time: the writer must not queue behind the loop's."""
    from spotguard.coordination.agreement import setup
    from tests.helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        groups = setup(1, async_save=True)
        shared = dist.distributed_c10d._get_default_store()
        assert isinstance(groups.store, dist.TCPStore) and groups.store is not shared
        groups.store.set("seen", "1")
        base = shared
        while isinstance(base, dist.PrefixStore):
            base = base.underlying_store
        assert base.get("seen") == b"1"  # the same server
        groups.close()
    finally:
        dist.destroy_process_group()


def test_a_background_commit_carries_the_slowest_ranks_own_work(tmp_path):
    """The emergency estimate's rate (``GuardStats.work_Bps``): the ranks write in parallel, so a save's own
    work is its slowest rank's, the same on every rank."""
    storage = LocalStorage(str(tmp_path))
    _, works, commits = ranks(storage)
    assert run(works)[0] == {0: "ok", 1: "ok"}
    work = [c[0].work_s for c in commits.values()]
    assert work[0] is not None and work[0] > 0 and work[0] == work[1], work
    assert work[0] <= commits[0][0].seconds
