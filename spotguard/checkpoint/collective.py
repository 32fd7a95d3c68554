"""What the ranks of a sharded save or resume agree on, and how model/optimizer state reaches DCP.

Every rank calls the same collectives in the same order whatever happens: a failure on one rank
is agreed on (``agree``) before the next collective, never acted on by one rank alone. Modules and
optimizers go through ``torch.distributed.checkpoint.state_dict`` (DDP and FSDP2 alike).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from spotguard import errors
from spotguard.errors import CheckpointMismatchError


class Groups(Protocol):
    """The process groups a sharded engine runs its collectives on (``spotguard.coordination.agreement.Agreement``)."""

    rank: int
    world_size: int
    save_group: Any  # synchronous saves and resume, from the loop's thread
    store: Any  # the job's key-value store, for background saves (None: saves are synchronous)
    uid: str  # this agreement's name in the store, the same on every rank
    timeout_s: float  # how long a rank waits for a peer's part of a background save

    def reduce(self, code: int, group: Any = None) -> int:
        """MAX of every rank's ``code`` on ``group``."""


def owner(opt: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    """The tracked module whose parameters this optimizer updates."""
    first = next(p for g in opt.param_groups for p in g["params"])
    for module in modules.values():
        if any(p is first for p in module.parameters()):
            return module
    raise CheckpointMismatchError("a tracked optimizer updates parameters of no tracked module: track the model too")


def split(objects: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer], dict[str, Any]]:
    modules = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    optims = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    rest = {n: o for n, o in objects.items() if n not in modules and n not in optims}
    return modules, optims, rest


# torch.distributed.checkpoint is imported where used: it costs ~1 s of CPU per process, and the
# Guard (every rank, every worker) loads this module whether or not it ever saves sharded.


def dcp_state(objects: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules, optims, _ = split(objects)
    sd: dict[str, Any] = {n: get_model_state_dict(m) for n, m in modules.items()}
    sd.update({n: get_optimizer_state_dict(owner(o, modules), o) for n, o in optims.items()})
    return sd


def set_dcp_state(objects: dict[str, Any], sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    modules, optims, _ = split(objects)
    for n, m in modules.items():
        set_model_state_dict(m, sd[n])
    for n, o in optims.items():
        set_optimizer_state_dict(owner(o, modules), o, sd[n])


def broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def failures(error: BaseException, rank: int) -> list[tuple[int, BaseException]]:
    """(rank, exception) behind one error: DCP hands every rank the exceptions of all failed ranks."""
    api = sys.modules.get("torch.distributed.checkpoint.api")  # never imported: not DCP's error (~1 CPU-s spared)
    if api is not None and isinstance(error, api.CheckpointException):
        return sorted(((r, exc) for r, (exc, _) in error.failures.items()), key=lambda f: f[0])
    return [(rank, error)]


def explain(error: BaseException, rank: int) -> str:
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures(error, rank))


def kind(error: BaseException) -> str:
    """The name of the spotguard error class that ``error`` is (or its nearest base), else SpotguardError."""
    return next((c.__name__ for c in type(error).__mro__ if c.__module__ == errors.__name__), "SpotguardError")


def agree(agreement: Groups, where: str, error: BaseException | None, what: str = "cannot be loaded") -> None:
    """Collective: raise on every rank when any rank failed, naming each rank's error.

    Corruption everywhere it failed is a ``CheckpointCorruptError`` (the caller tries an older
    checkpoint, as a single process does); anything else (a storage error, state that does not fit)
    is raised as the spotguard error class of the lowest failing rank.
    """
    local = [(r, kind(e), f"{type(e).__name__}: {e}") for r, e in failures(error, agreement.rank)] if error else []
    corrupt = errors.CheckpointCorruptError.__name__
    # MAX of every rank's code: a failure on one rank reaches all before the next collective.
    if not agreement.reduce(max((1 if k == corrupt else 2 for _, k, _ in local), default=0), agreement.save_group):
        return
    reports: list[Any] = [None] * agreement.world_size
    dist.all_gather_object(reports, local, group=agreement.save_group)
    found = sorted({f for per_rank in reports for f in per_rank})  # DCP reports the same on every rank
    name = next((k for _, k, _ in found if k != corrupt), corrupt)
    text = "; ".join(f"rank {r}: {msg}" for r, _, msg in found)
    raise getattr(errors, name)(f"{where} {what}: {text}") from error
