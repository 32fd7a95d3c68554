"""A background sharded save's DCP plan, agreed before anything is staged: a rank copies only what it writes.

Why: under DDP every rank holds the whole (replicated) model and optimizer state, and DCP's global
plan gives each replicated item to one rank only (``dedup_save_plans``, balanced by size). Staging
the whole state on every rank before the plan is known copied each item ``world`` times for one
write: host memory and the loop's stall grew with the world size, not with a rank's share.

Order, on the loop's thread at ``ShardedEngine.stage`` (every rank stages the same saves, right
after the collectives that decided it): each rank plans its items (``create_local_plan``) and
publishes the plan under ``plan/R`` in the job's store; rank 0 reads them all, makes the global
plan and DCP's metadata (``create_global_plan``, deduplicated) and publishes each rank's part
under ``gplan/R``. Each rank then stages the items of its final plan only (flattened, by their
DCP name), and its background writer writes them with that plan (``sharded_async.write``). A
rank that cannot plan (its state failed to collect, a peer's failure, the timeout) publishes why
under every key it still owes, so no rank waits for it, and carries the reason into its write,
which fails the save on every rank alike.

Planning every item of every rank costs the loop's thread (4000 items: tens of ms for a rank's own
plan, more for rank 0's global one, growing with the world size), and a state's structure rarely
changes between saves: each engine keeps the plan agreed last (``Cache``). A rank whose local plan
is unchanged sends only the tag of the save that sent it, rank 0 reuses the global plan when no
rank's changed, and a rank whose final plan is unchanged is told so in a word. Any failure forgets
the cache on the rank that saw it; a tag rank 0 does not know fails that save, and the next plans anew.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from spotguard.checkpoint.sharded.dcp import SpotguardWriter
from spotguard.checkpoint.sharded.sharded_async import FAILED, OK, Exchange, Stopped


@dataclasses.dataclass
class Planned:
    """This rank's final DCP plan, the items it writes (DCP name -> value) and, on rank 0, the metadata."""

    plan: SavePlan | None
    items: dict[str, Any]
    metadata: Metadata | None = None
    error: str = ""

    def planner(self, rank: int) -> SavePlanner:
        """A planner over ``items`` (already flat) that resolves the final plan's items, in the writer's thread."""
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        planner.set_up_planner(state_dict=self.items, is_coordinator=rank == 0)
        return planner


@dataclasses.dataclass
class Cache:
    """The last plan agreed, kept by each rank's engine: a state of the same structure (DCP's local plan:
    names, shapes, dtypes) is not planned again. Rank 0 keeps every rank's local plan and final plan,
    each rank its own, with ``tag`` (the save that sent it); any failure forgets it all (``clear``)."""

    tag: int = 0  # a rank but 0: the save that sent ``local``
    local: SavePlan | None = None  # a rank but 0: its local plan, as rank 0 keeps it
    final: SavePlan | None = None  # a rank but 0: its final plan
    tags: list[int] | None = None  # rank 0: the save that sent each rank's local plan
    plans: list[SavePlan] | None = None  # rank 0: every rank's local plan
    finals: list[SavePlan] | None = None  # rank 0: every rank's final plan
    metadata: Metadata | None = None  # rank 0
    shape: tuple[Any, ...] | None = None  # this rank's state's ``structure`` when ``own`` was planned
    own: SavePlan | None = None  # this rank's local plan for ``shape``: not made again while it holds

    def clear(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


SAME, NEW = "same", "new"


def agree(
    ex: Exchange,
    writer: SpotguardWriter,
    sd: dict[str, Any] | None,
    error: str = "",
    cache: Cache | None = None,
    tag: int = 0,
) -> Planned:
    """Every rank, for the same save (``tag``, the same on every rank): the global plan through the store
    (see the module docstring).

    ``sd``: this rank's DCP state (live tensors), or None with ``error`` when it could not be
    collected. ``cache``: the plan agreed last time; a rank whose local plan did not change sends only
    its tag, and rank 0 makes a new global plan only when some rank's changed (the most costly part
    on the loop's thread: every item of every rank). Never raises: a failure is returned in
    ``Planned.error``, and forgets the cache.
    """
    rank, world = ex.rank, ex.world
    cache = cache if cache is not None else Cache()
    owed = [f"gplan/{r}" for r in range(1, world)] if rank == 0 else [f"plan/{rank}"]
    try:
        if error or sd is None:
            raise Stopped(FAILED, error)
        planner = DefaultSavePlanner()  # its default dedup: each replicated item to one rank
        shape = structure(sd)
        fast = shape is not None and shape == cache.shape and cache.own is not None
        if fast and cache.own is not None:  # the same names, shapes and dtypes: the same local plan
            local = cache.own
        else:
            planner.set_up_planner(state_dict=sd, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            local = writer.prepare_local_plan(planner.create_local_plan())
            cache.shape, cache.own = shape, local
        metadata: Metadata | None = None
        if rank == 0:
            plan, kept = _global(ex, writer, planner, local, cache, tag, owed)
            metadata = dataclasses.replace(kept)  # finish() sets its storage_data: not the cached one's
        else:
            same = cache.local is not None and cache.final is not None and local == cache.local
            ex.put(f"plan/{rank}", OK, (SAME, cache.tag) if same else (NEW, local))
            owed.remove(f"plan/{rank}")
            kind, got = ex.get(f"gplan/{rank}")
            if kind == NEW:
                plan = cache.final = got
                if not same:
                    cache.tag, cache.local = tag, local
            elif cache.final is not None:
                plan = cache.final
            else:
                raise Stopped(FAILED, f"rank {rank}: rank 0 kept a plan this rank no longer has")
        names = list(dict.fromkeys(item.index.fqn for item in plan.items))  # in the plan's order, every save alike
        if fast:  # found where DCP's flattening found them (its mappings: name -> path in ``sd``)
            paths = local.planner_data
            return Planned(plan, {name: _lookup(sd, paths[name]) for name in names}, metadata)
        flat = planner.state_dict
        return Planned(plan, {name: flat[name] for name in names}, metadata)
    except Exception as e:
        cache.clear()  # the next save plans anew, on every rank
        reason = e.reason if isinstance(e, Stopped) else f"rank {rank}: cannot plan: {type(e).__name__}: {e}"
        for key in owed:
            try:
                ex.put(key, FAILED, reason)
            except Exception:  # the store itself is gone: the peers' waits end with their own errors
                break
        return Planned(None, {}, error=reason or f"rank {rank}: the save's plan was not agreed")


def _global(
    ex: Exchange,
    writer: SpotguardWriter,
    planner: DefaultSavePlanner,
    local: SavePlan,
    cache: Cache,
    tag: int,
    owed: list[str],
) -> tuple[SavePlan, Metadata]:
    """Rank 0: every rank's local plan (or its tag: unchanged since the cached one), the global plan (the
    cached one when no rank's plan changed), and each rank's part published. Raises ``Stopped``."""
    world = ex.world
    plans, tags, unchanged = [local], [tag], [cache.plans is not None and local == cache.plans[0]]
    for r in range(1, world):
        kind, value = ex.get(f"plan/{r}")
        if kind == SAME:
            if cache.plans is None or cache.tags is None or cache.tags[r] != value:
                raise Stopped(FAILED, f"rank {r}'s plan is not the one rank 0 kept: the next save plans anew")
            plans.append(cache.plans[r])
            tags.append(value)
        else:
            plans.append(value)
            tags.append(tag)
        unchanged.append(kind == SAME)
    if all(unchanged) and cache.finals is not None and cache.metadata is not None:
        finals, metadata = cache.finals, cache.metadata
    else:
        finals, metadata = planner.create_global_plan(plans)
        finals = writer.prepare_global_plan(finals)
    for r in range(1, world):
        same = unchanged[r] and cache.finals is not None and finals[r] == cache.finals[r]
        ex.put(f"gplan/{r}", OK, (SAME, None) if same else (NEW, finals[r]))
        owed.remove(f"gplan/{r}")
    cache.tags, cache.plans, cache.finals, cache.metadata = tags, plans, finals, metadata
    return finals[0], metadata


def structure(sd: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a local plan depends on, walked without DCP's flattening (a fraction of its cost): every
    container's keys or length, every tensor's kind, shape and dtype (a DTensor's local shape and
    placements too), every other value's type. None where the state holds a ``ShardedTensor``, which
    DCP's flattening rewrites: always planned."""
    out: list[Any] = []
    stack: list[Any] = [sd]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if type(obj).__name__ == "ShardedTensor":
                return None
            if hasattr(obj, "_local_tensor") and hasattr(obj, "_spec"):  # a DTensor
                local = obj._local_tensor
                out.append((obj.shape, obj.dtype, local.shape, repr(obj._spec.placements)))
            else:
                out.append((type(obj), obj.shape, obj.dtype))
        elif isinstance(obj, dict):
            out.append(tuple(obj))
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            out.append((type(obj), len(obj)))
            stack.extend(obj)
        elif type(obj).__name__ == "ShardedTensor":
            return None
        else:
            out.append(type(obj))
    return tuple(out)


def _lookup(sd: dict[str, Any], path: Any) -> Any:
    obj: Any = sd
    for key in path:
        obj = obj[key]
    return obj
