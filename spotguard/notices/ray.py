"""Ray's own preemption signal: the cluster's drain of a node, as Ray Train hands it to each worker.

When a node is reclaimed the cluster marks it draining with a deadline (the autoscaler or KubeRay
from the cloud's notice; ``ray start --block`` on SIGTERM); Ray Train's controller watches the
drains and answers ``ray.train.get_preemption_info()`` (Ray >= 2.60, alpha) on every worker with the
earliest deadline and the ranks of each draining node. That call is a barrier across the workers
(rank 0's answer is broadcast): every rank must make it the same number of times. So this source
has no watcher thread (``channels()`` is empty, ``in_step`` is True): the Guard polls it from the
training loop's thread, where the ranks already synchronise (its vote, ``guard.insync``), and every
rank, the draining node's and the others alike, gets the same notice at the same step.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import Notice, NoticeProvider

logger = logging.getLogger(__name__)

#: The module Ray Train's worker sets up; its presence in ``sys.modules`` is checked first, so that
#: outside Ray nothing is imported.
_UTILS = "ray.train.v2._internal.execution.train_fn_utils"
#: How often Ray Train's controller looks at the drains (its ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``,
#: 5 s by default): asking its answer more often than it changes buys nothing, and each call is a round
#: trip through Ray's synchronisation actor (4-9 ms measured on a loaded 2-core machine,
#: ``bench/ray_preemption.py``); every ``MAX_POLL_GAP_S`` at most keeps it under 1% of a 50 ms step.
MAX_POLL_GAP_S = 2.0
RAY_POLL_ENV, RAY_POLL_DEFAULT_S = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", 5.0


def in_ray_train_worker() -> bool:
    """Whether this process runs a Ray Train (v2) training function that can ask for preemption info.

    Never imports Ray: a process that has not imported Ray Train is not one of its workers.
    """
    utils = sys.modules.get(_UTILS)
    if utils is None:
        return False
    try:
        current = utils.get_train_fn_utils()
    except Exception:  # "not initialized": the driver, or a plain Ray task
        return False
    distributed = getattr(utils, "DistributedTrainFnUtils", None)
    return distributed is not None and isinstance(current, distributed) and hasattr(current, "get_preemption_info")


def _preemption_info() -> Any:
    import ray.train

    return ray.train.get_preemption_info()


def _world() -> tuple[int, int]:
    import ray.train

    context = ray.train.get_context()
    return context.get_world_rank(), context.get_world_size()


def _ray_poll_interval() -> float:
    try:
        return max(float(os.environ.get(RAY_POLL_ENV, RAY_POLL_DEFAULT_S)), 0.0)
    except ValueError:
        return RAY_POLL_DEFAULT_S  # Ray itself reports its unreadable variable


class RayProvider(NoticeProvider):
    """A stop notice while Ray Train reports a preemption of any node of the run.

    ``get_info`` returns Ray's ``PreemptionInfo`` or None (default: ``ray.train.get_preemption_info``;
    tests and a trainer with its own loop may pass another); ``world`` returns (rank, world size).
    """

    name = "ray"
    in_step = True

    def __init__(
        self,
        get_info: Callable[[], Any] | None = None,
        world: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        if get_info is None and not in_ray_train_worker():
            raise ConfigError(
                "the 'ray' notice source works inside a Ray Train worker only (ray[train] >= 2.60, "
                "ray.train.get_preemption_info); leave it out of providers elsewhere"
            )
        self._get_info = get_info or _preemption_info
        self._world = world or _world
        self.rank, self.world_size = self._world()
        #: The least time between two calls (``guard.insync`` polls no more often, whatever ``interval``):
        #: each costs a round trip through Ray's synchronisation actor on every rank.
        self.min_interval = min(MAX_POLL_GAP_S, _ray_poll_interval())

    def channels(self) -> list[NoticeProvider]:
        return []  # never from a watcher thread: the call is a barrier across the workers

    def poll(self) -> Notice | None:
        """One call of Ray's barrier; a notice built from its answer, or None."""
        info = self._get_info()
        if info is None:
            return None
        nodes = {str(node): sorted(int(r) for r in ranks) for node, ranks in info.preempted_node_to_ranks.items()}
        ms = info.deadline_ms
        deadline = None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
        draining = any(self.rank in ranks for ranks in nodes.values())
        raw = {"reason": "node drain (preemption)", "deadline_ms": ms, "preempted_node_to_ranks": nodes}
        notice = Notice(self.name, "preempt", deadline=deadline, raw=raw)
        logger.debug(
            "rank %d: Ray reports a preemption of ranks %s (%s)",
            self.rank,
            sorted({r for ranks in nodes.values() for r in ranks}),
            "this node drains" if draining else "another node drains",
        )
        return notice
