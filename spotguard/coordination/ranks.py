"""Who this process is in a job: its rank, and which notice sources it polls.

Read from the initialised process group, else from torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``), so that a Guard built before ``init_process_group`` still knows its place.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from spotguard import _env, notices
from spotguard.notices.base import NoticeProvider

logger = logging.getLogger(__name__)

#: Sources every rank watches; any other provider (cloud metadata) is node-wide. Ray's drain is asked
#: for by every rank: its call is a barrier across the workers (``spotguard.notices.ray``).
PER_PROCESS_PROVIDERS = frozenset({"signal", "file", "ray"})


class PollOn(str, enum.Enum):
    """Which ranks poll node-wide notice sources (cloud metadata)."""

    LOCAL_RANK_0 = "local-rank-0"
    ALL = "all"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """The global rank: the process group's, else ``RANK``, else what Lightning's own launcher says."""
    if is_distributed():
        return dist.get_rank()
    if "RANK" in os.environ or "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        return int(os.environ.get("RANK", 0))
    # Lightning's launcher (Trainer(devices=N) run as a script) sets LOCAL_RANK and NODE_RANK, not RANK:
    # read as 0, every child took itself for rank 0 before the group existed (the writer lease refused
    # them as a second job). Its global rank is node * devices + local; devices per node where known
    # (LOCAL_WORLD_SIZE), else only whether it is 0 is sure. One process (WORLD_SIZE 1) is rank 0.
    node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ["LOCAL_RANK"])
    return node * int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)) + local


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``; the global rank otherwise)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


@dataclass(frozen=True)
class Place:
    """Where this process is in its job: what exporters label their figures and files with."""

    rank: int
    local_rank: int
    world_size: int

    def format(self, template: str) -> str:
        """Fill ``{rank}``, ``{local_rank}`` and ``{world_size}`` in a path (per-rank notice files, logs)."""
        return template.format(rank=self.rank, local_rank=self.local_rank, world_size=self.world_size)


def place() -> Place:
    """This process's place now (the process group's, once one is initialised; else torchrun's variables)."""
    return Place(rank(), local_rank(), world_size())


def format_per_rank(template: str) -> str:
    """Fill ``{rank}``, ``{local_rank}`` and ``{world_size}`` in a path (per-rank notice files, logs)."""
    return place().format(template)


def providers_for_rank(
    spec: str | Iterable[str | NoticeProvider] | None, poll_on: PollOn | str = PollOn.LOCAL_RANK_0
) -> Any:
    """The notice providers this rank runs. Unchanged outside torchrun / a process group.

    Signals and the notice file are per process (a scheduler may signal any rank; a rank-templated
    ``$SPOTGUARD_NOTICE_FILE`` like ``/tmp/notice-{rank}`` gives each rank its own file); other
    providers (cloud metadata) run on local rank 0 only unless ``poll_on="all"``.
    """
    if spec is None or ("LOCAL_RANK" not in os.environ and not is_distributed()):
        return spec
    if isinstance(spec, str):
        if spec == "auto":
            names: list[str | NoticeProvider] = list(notices.auto_names())
        else:
            names = [part.strip() for part in spec.split(",") if part.strip()]
    else:
        names = list(spec)
    chosen: list[str | NoticeProvider] = []
    for item in names:
        if isinstance(item, NoticeProvider) or item in ("signal", "ray"):
            chosen.append(item)
        elif item == "file":
            template = _env.text(_env.NOTICE_FILE) or ""
            if "{" in template:
                from spotguard.notices.file import FileProvider

                chosen.append(FileProvider(format_per_rank(template)))
            else:
                chosen.append(item)
        elif PollOn(poll_on) is PollOn.ALL or local_rank() == 0:
            chosen.append(item)
        else:
            logger.debug("rank %d: %s is polled by local rank 0 only", rank(), item)
    return chosen
