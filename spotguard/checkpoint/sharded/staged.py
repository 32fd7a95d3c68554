"""What one rank of a sharded save writes, collected from the live state on the loop's thread."""

from __future__ import annotations

import dataclasses
from typing import Any

from spotguard.checkpoint.collective import Groups, dcp_state, explain, split
from spotguard.checkpoint.engine import Tracked, copy_extra
from spotguard.checkpoint.state import data, state


@dataclasses.dataclass
class Staged:
    """What one rank saves: its own file's payload, its DCP state dict, or why it could not collect them."""

    payload: dict[str, Any]
    sd: dict[str, Any]
    error: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # guard.extra when collected


def collected(tracked: Tracked, groups: Groups, step: int, final: bool = False) -> Staged:
    """This rank's state, its live tensors, never raising (a failure is carried, then agreed on by the save)."""
    rank, world = groups.rank, groups.world_size
    _, _, rest = split(tracked.objects)
    cut = tracked.cut_at(step, final)
    with state.rng_isolated():
        try:
            rng = cut.rng if cut else state.capture_rng()  # first: collecting a loader's state may draw
            objects = state.collect(rest)
            if cut:
                data.as_at_last_batch(rest, objects)
            payload = {
                "step": step,
                "rank": rank,
                "world_size": world,
                "rng": rng,
                "objects": objects,
                "generators": {n: g for n, o in rest.items() if (g := data.generator_state(o)) is not None},
                "loaders": data.loader_facts(rest),  # what a resume compares (worker count, batch size)
            }
            sd = dcp_state(tracked.objects)
            return Staged(payload, sd, extra=copy_extra(tracked.extra))  # this step's, whatever comes later
        except Exception as e:
            return Staged({}, {}, explain(e, rank))
