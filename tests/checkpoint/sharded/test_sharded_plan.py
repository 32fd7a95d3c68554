"""What each rank of a background sharded save stages: DCP's plan, agreed as the save is staged (``sharded_plan``).

Two ranks as two threads on one HashStore, as in test_sharded_async.py; the two-process DDP case is in
test_sharded.py.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from spotguard.checkpoint import open_verified, scan
from spotguard.checkpoint.engine import Tracked
from spotguard.checkpoint.sharded.dcp import SpotguardReader, load_metadata
from spotguard.checkpoint.sharded.sharded import ShardedEngine
from spotguard.checkpoint.state.budget import Budget
from spotguard.storage import LocalStorage
from tests.checkpoint.sharded.test_sharded_async import ranks, run


def test_each_replicated_item_is_staged_by_the_one_rank_that_writes_it(tmp_path):
    """Every rank holds the same (replicated, as under DDP) state: DCP's plan gives each item to one rank,
    and that rank alone copies it to host memory; the checkpoint still holds every item."""
    storage = LocalStorage(str(tmp_path))
    engines, works, commits = ranks(storage)
    whole = sum(p.numel() * p.element_size() for p in nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).parameters())
    staged = [e.staged_bytes for e in engines]
    assert sum(staged) == whole and 0 < staged[1] < whole, staged
    assert run(works)[0] == {0: "ok", 1: "ok"}
    metadata = load_metadata(tmp_path / "step-00000001" / "shards" / "metadata.dcp")
    assert {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"} <= set(metadata.state_dict_metadata)


def test_the_staging_of_the_items_a_rank_writes_is_reserved_before_the_first_save(tmp_path):
    """``reserve`` (every rank at its first step) agrees on the plan as a save does, and allocates the
    buffers of this rank's items off the loop: the first save allocates nothing, and leaves no keys."""
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    engines, models, commits = [], [], {0: [], 1: []}
    for r in range(2):
        groups = SimpleNamespace(rank=r, world_size=2, store=store, uid="t", timeout_s=30.0, save_group=None)
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        engines.append(ShardedEngine(storage, groups, keep=3, on_commit=commits[r].append))

    each(lambda r: engines[r].reserve(Tracked({"model": models[r]}, {})))
    for e in engines:
        e._reserving.join()
        e._staging._reserving.join()
    assert store.num_keys() == 0
    assert sum(len(e._staging._reserved) for e in engines) == 4  # each weight and bias, by one rank
    works: list = [None, None]
    each(lambda r: works.__setitem__(r, engines[r].stage(Tracked({"model": models[r]}, {}), 1, "periodic")))
    assert [e._staging.allocations for e in engines] == [0, 0] and all(e.alloc_s < 0.05 for e in engines)
    assert run(works)[0] == {0: "ok", 1: "ok"} and store.num_keys() == 0


def test_reserving_does_not_hold_the_loop_while_a_peer_is_late(tmp_path, caplog):
    """The plan is agreed on a thread of its own: a rank whose peer has not reached its first step yet
    returns from ``reserve`` at once (it waited up to a minute on the loop's thread before); a peer that
    never comes costs a warning, and the first save then plans and allocates as it would have."""
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    groups = SimpleNamespace(rank=0, world_size=2, store=store, uid="t", timeout_s=3.0, save_group=None)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    engine = ShardedEngine(storage, groups, keep=3, on_commit=lambda c: None)
    t0 = time.monotonic()
    engine.reserve(Tracked({"model": model}, {}))
    assert time.monotonic() - t0 < 1.5 and engine._reserving.is_alive()  # the peer's wait is 3 s
    engine._reserving.join(10)
    assert "cannot reserve the checkpoint staging" in caplog.text
    assert engine._staging._reserving is None and engine._staging.nbytes == 0  # nothing allocated


def test_a_state_of_unchanged_structure_is_not_planned_again(tmp_path, monkeypatch):
    """The global plan (every item of every rank, on the loop's thread) is made once while no rank's local
    plan changes; a changed state is planned anew, and every save still commits and loads."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    made, local = [], []
    original, original_local = DefaultSavePlanner.create_global_plan, DefaultSavePlanner.create_local_plan
    monkeypatch.setattr(DefaultSavePlanner, "create_global_plan", lambda self, p: made.append(1) or original(self, p))
    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", lambda self: local.append(1) or original_local(self))
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    engines, commits = [], {0: [], 1: []}
    models = []
    for r in range(2):
        torch.manual_seed(0)  # replicated, as under DDP
        models.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        groups = SimpleNamespace(rank=r, world_size=2, store=store, uid="t", timeout_s=30.0, save_group=None)
        engines.append(ShardedEngine(storage, groups, keep=5, on_commit=commits[r].append))

    def save(step, objects):
        works: list = [None, None]
        threads = [
            threading.Thread(
                target=lambda r=r: works.__setitem__(r, engines[r].stage(Tracked(objects[r], {}), step, "p"))
            )
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert run(works)[0] == {0: "ok", 1: "ok"}

    for step in (1, 2, 3):
        with torch.no_grad():
            for m in models:
                m[1].weight.fill_(step)  # each save's values, with the same structure
        save(step, [{"model": m} for m in models])
        if step == 1:
            allocated = [e._staging.allocations for e in engines]
    assert len(made) == 1 and len(local) == 2  # one plan per rank: the later saves found the same structure
    assert [e._staging.allocations for e in engines] == allocated  # and the same buffers, in the same order
    info = next(i for i in scan(storage) if i.step == 3)
    sd = {"model": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).state_dict()}
    with SpotguardReader(lambda name: open_verified(storage, info, name)) as reader:
        dcp.load(sd, storage_reader=reader, no_dist=True)
    assert torch.equal(sd["model"]["1.weight"], torch.full((2, 8), 3.0))
    assert all(torch.equal(sd["model"][k], v) for k, v in models[0].state_dict().items())
    bigger = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)) for _ in range(2)]
    save(4, [{"model": m} for m in bigger])
    assert len(made) == 2 and len(local) == 4 and store.num_keys() == 0
    metadata = load_metadata(tmp_path / "step-00000004" / "shards" / "metadata.dcp")
    assert metadata.state_dict_metadata["model.1.weight"].size == torch.Size([3, 8])
    assert [len(c) for c in commits.values()] == [4, 4]


def test_a_rank_over_its_staging_budget_writes_its_share_now_while_the_other_stages(tmp_path):
    """Rank 1's share does not fit its budget: it copies nothing and writes its items from the live state
    before its ``stage`` returns, while rank 0 stages and writes in the background (as the Guard runs a
    work: on a thread of its own once staged). One checkpoint, every item, nothing left in the store."""
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    engines, models, commits = [], [], {0: [], 1: []}
    for r in range(2):
        groups = SimpleNamespace(rank=r, world_size=2, store=store, uid="t", timeout_s=30.0, save_group=None)
        torch.manual_seed(0)  # replicated, as under DDP
        models.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        engines.append(ShardedEngine(storage, groups, keep=3, on_commit=commits[r].append, staging_budget=None))
    engines[1].budget = Budget(16)  # bytes: less than any item
    returned: dict[int, bool] = {}

    def save(r: int) -> None:
        work = engines[r].stage(Tracked({"model": models[r]}, {}), 1, "periodic")
        returned[r] = bool(commits[r])  # committed before stage returned?
        work(threading.Event())

    threads = [threading.Thread(target=save, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert returned == {0: False, 1: True}  # rank 1 waited for the commit; rank 0 only staged
    assert [len(c) for c in commits.values()] == [1, 1] and store.num_keys() == 0
    assert engines[1].staged_bytes == 0 < engines[0].staged_bytes
    info = next(i for i in scan(storage) if i.step == 1)
    sd = {"model": nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).state_dict()}
    with SpotguardReader(lambda name: open_verified(storage, info, name)) as reader:
        dcp.load(sd, storage_reader=reader, no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in models[0].state_dict().items())


class Grows:
    """A tracked object whose ``state_dict()`` is its own live dict, which the loop adds to as it trains."""

    def __init__(self) -> None:
        self.d: dict = {f"k{i}": [i] for i in range(100_000)}

    def state_dict(self) -> dict:
        return self.d

    def load_state_dict(self, state: dict) -> None:
        self.d = dict(state)


def two_engines(tmp_path, timeout=10.0, staging_budget=None):
    store = dist.HashStore()
    storage = LocalStorage(str(tmp_path))
    engines, models = [], []
    for r in range(2):
        groups = SimpleNamespace(rank=r, world_size=2, store=store, uid="t", timeout_s=timeout, save_group=None)
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
        engines.append(ShardedEngine(storage, groups, keep=3, on_commit=lambda c: None, staging_budget=staging_budget))
    return store, engines, models


def each(call):
    """``call(rank)`` for both ranks at once, each on a thread of its own (as each rank's loop)."""
    threads = [threading.Thread(target=call, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def test_the_reservation_walks_no_dict_the_loop_is_changing(tmp_path, caplog):
    """The thread walks a copy of the objects' containers taken on the loop's thread: the loop adding to a
    tracked object's own dict meanwhile neither fails the reservation nor the first save."""
    store, engines, models = two_engines(tmp_path)
    grows = [Grows(), Grows()]
    each(lambda r: engines[r].reserve(Tracked({"model": models[r], "counts": grows[r]}, {})))
    i = 0
    while any(e._reserving.is_alive() for e in engines) and i < 1_000_000:  # the loop trains on meanwhile
        grows[0].d[f"n{i}"] = [i]
        i += 1
    for e in engines:
        e._reserving.join()
    assert "cannot reserve" not in caplog.text
    works: list = [None, None]
    each(
        lambda r: works.__setitem__(r, engines[r].stage(Tracked({"model": models[r], "counts": grows[r]}, {}), 1, "p"))
    )
    assert run(works)[0] == {0: "ok", 1: "ok"}


def test_a_failed_allocation_on_rank_0_keeps_the_plan_every_rank_agreed(tmp_path, monkeypatch):
    """Only the staging is lost: the plan stays in rank 0's cache as in the others', so the first save's
    "same plan" from the other ranks is the one rank 0 kept, and it commits."""
    store, engines, models = two_engines(tmp_path)

    def refused(state):
        raise RuntimeError("pinned memory refused")

    monkeypatch.setattr(engines[0]._staging, "reserve", refused)
    each(lambda r: engines[r].reserve(Tracked({"model": models[r]}, {})))
    for e in engines:
        e._reserving.join()
    works: list = [None, None]
    each(lambda r: works.__setitem__(r, engines[r].stage(Tracked({"model": models[r]}, {}), 1, "periodic")))
    assert run(works)[0] == {0: "ok", 1: "ok"}


def test_a_rank_over_its_staging_budget_reserves_nothing(tmp_path):
    store, engines, models = two_engines(tmp_path, staging_budget=16)
    each(lambda r: engines[r].reserve(Tracked({"model": models[r]}, {})))
    for e in engines:
        e._reserving.join()
        assert e._staging._reserving is None and e._staging._reserved == []


def test_closing_the_engine_ends_a_reservation_still_waiting_for_its_peer(tmp_path, caplog):
    """A guard closed before its first staged save: the reservation waiting for a late peer gives up at once
    instead of holding a thread for the store's timeout (and allocating after the guard is gone)."""
    store = dist.HashStore()
    groups = SimpleNamespace(rank=0, world_size=2, store=store, uid="t", timeout_s=60.0, save_group=None)
    engine = ShardedEngine(LocalStorage(str(tmp_path)), groups, keep=3, on_commit=lambda c: None)
    engine.reserve(Tracked({"model": nn.Linear(8, 8)}, {}))
    time.sleep(0.2)
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 < 5 and not engine._reserving.is_alive()
    assert engine._staging._reserving is None and engine._staging.nbytes == 0
