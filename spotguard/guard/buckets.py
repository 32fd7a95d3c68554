"""Pin a DistributedDataParallel model's gradient buckets, so that a resumed job adds like the one it replaces.

DDP all-reduces gradients packed into flat buckets. A fresh DDP packs them in parameter order; after
its first backward pass the Reducer rebuilds the buckets once, in the order the gradients became
ready. The sum a collective computes for one element depends on where the element lies in the flat
buffer (gloo's ring, NCCL's chunks start the sum at another rank), so with three ranks or more the
two layouts give sums that differ in the last bits (two ranks add ``a + b``, the same in any order).
A job resumed at step k runs step k+1 in the fresh layout where the uninterrupted one ran it in the
rebuilt one: its weights drift apart from there.

``pin()`` rebuilds the buckets of a DDP that has not rebuilt them yet, before its first step, in
parameter order (the only order the Reducer can be given without a backward pass). Every run then
reduces every step in the same layout. Called on every rank together: the Reducer broadcasts rank
0's layout. Free while the gradients fit DDP's first bucket (1 MiB): one bucket is reduced after the
whole backward pass in any layout. Over it, a pinned model no longer overlaps its all-reduces with
the backward pass (they wait for the first parameters' gradients, computed last): that costs
training speed, so it is done only when asked (``always``); by default such a model keeps DDP's
own layout, and an INFO line says that its resumes may differ in the last bits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

#: Below this many ranks every summation order gives the same bits: nothing to pin.
MIN_RANKS = 3


def pin(objects: Iterable[Any], always: bool = False) -> int:
    """Pin the buckets of each DDP among ``objects`` that would still rebuild them, when that is free
    (or ``always``); return how many were pinned."""
    pinned = 0
    for obj in objects:
        if isinstance(obj, DistributedDataParallel) and _pin_one(obj, always):
            pinned += 1
    return pinned


def is_free(grad_bytes: int, first_bucket: int | None = None) -> bool:
    """Whether pinning costs nothing: the gradients fit DDP's first bucket (1 MiB unless the DDP was
    given ``bucket_cap_mb``), reduced after the whole backward pass whatever the layout."""
    cap = int(first_bucket or getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None) or 2**20)
    return grad_bytes <= cap


def _pin_one(ddp: DistributedDataParallel, always: bool) -> bool:
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_push_all_rebuilt_params"):  # python reducer, or a future DDP
        return False
    if dist.get_world_size(ddp.process_group) < MIN_RANKS or getattr(ddp, "_has_rebuilt_buckets", False):
        return False
    grads = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
    free = is_free(grads, getattr(getattr(ddp, "_bucket_config", None), "first_bucket_bytes_cap", None))
    if not (free or always):
        logger.info(
            "DDP keeps its own gradient buckets (%.1f MiB of gradients): with %d ranks a resumed run may "
            "differ from an uninterrupted one in the last bits; Guard(pin_ddp_buckets=True) makes it exact, "
            "at the cost of overlapping all-reduces with the backward pass",
            grads / 2**20,
            dist.get_world_size(ddp.process_group),
        )
        return False
    # A no-op where the Reducer never rebuilds (find_unused_parameters=True) or already has.
    reducer._push_all_rebuilt_params()
    if not reducer._rebuild_buckets():
        return False
    ddp._has_rebuilt_buckets = True  # as DDP's forward would have set it
    logger.info(
        "pinned the DDP gradient buckets (%.1f MiB) to parameter order for an exact resume%s",
        grads / 2**20,
        "" if free else "; all-reduces no longer overlap the backward pass",
    )
    return True
