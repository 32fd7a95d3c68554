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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from spotguard.checkpoint.dcp import SpotguardWriter
from spotguard.checkpoint.sharded_async import FAILED, OK, Exchange, Stopped


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


def agree(ex: Exchange, writer: SpotguardWriter, sd: dict[str, Any] | None, error: str = "") -> Planned:
    """Every rank, for the same save: the global plan through the store (see the module docstring).

    ``sd``: this rank's DCP state (live tensors), or None with ``error`` when it could not be
    collected. Never raises: a failure is returned in ``Planned.error``.
    """
    rank, world = ex.rank, ex.world
    owed = [f"gplan/{r}" for r in range(1, world)] if rank == 0 else [f"plan/{rank}"]
    try:
        if error or sd is None:
            raise Stopped(FAILED, error)
        planner = DefaultSavePlanner()  # its default dedup: each replicated item to one rank
        planner.set_up_planner(state_dict=sd, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        local = writer.prepare_local_plan(planner.create_local_plan())
        metadata = None
        if rank == 0:
            plans = [local] + [ex.get(f"plan/{r}") for r in range(1, world)]
            plans, metadata = planner.create_global_plan(plans)
            plans = writer.prepare_global_plan(plans)
            for r in range(1, world):
                ex.put(f"gplan/{r}", OK, plans[r])
                owed.remove(f"gplan/{r}")
            plan = plans[0]
        else:
            ex.put(f"plan/{rank}", OK, local)
            owed.remove(f"plan/{rank}")
            plan = ex.get(f"gplan/{rank}")
        plan = planner.finish_plan(plan)
        names = {item.index.fqn for item in plan.items}
        return Planned(plan, {k: v for k, v in planner.state_dict.items() if k in names}, metadata)
    except Exception as e:
        reason = e.reason if isinstance(e, Stopped) else f"rank {rank}: cannot plan: {type(e).__name__}: {e}"
        for key in owed:
            try:
                ex.put(key, FAILED, reason)
            except Exception:  # the store itself is gone: the peers' waits end with their own errors
                break
        return Planned(None, {}, error=reason or f"rank {rank}: the save's plan was not agreed")
