"""The interface between the Guard and a way of writing checkpoints: one process, or sharded.

An engine gets the tracked state and returns values; it never sees the Guard. Call order, from
the training loop's thread: ``resume(tracked)`` once, then per checkpoint either ``save()``
(synchronous) or ``stage()`` (snapshot now; the returned ``Work`` runs on one background thread,
one at a time). Each commit, to each tier, is reported to the ``on_commit`` callback the engine
was built with, from whichever thread wrote it.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.state.state import Untracked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cut:
    """An evaluation cut short by a stop after training step ``step`` (``Guard.evaluation``): a save of
    that step keeps the RNG streams as the evaluation found them, and each loader as at its last batch,
    so the resumed run evaluates again from the start with the same random draws."""

    step: int | None
    rng: dict[str, Any]
    extra: dict[str, Any]  # ``guard.extra`` when it began: a change means the loop went past the evaluation


@dataclass
class Tracked:
    """What a Guard tracks: the objects under their names, and ``guard.extra`` (JSON values)."""

    objects: dict[str, Any]
    extra: dict[str, Any]
    cut: Cut | None = None  # an evaluation begun after the last training step (``Guard.evaluation``)
    untracked: Untracked | str = Untracked.REFUSE  # a resume meets saved state nothing tracks (``state``)

    def cut_at(self, step: int, final: bool = False) -> Cut | None:
        """The evaluation a save of ``step`` must undo, if any: one begun after training step ``step``,
        for any save but the final one, as long as the loop has not changed ``guard.extra`` since (its
        end-of-epoch code ran: the state is no longer the step's)."""
        cut = self.cut
        if cut is None or final or cut.step != step:
            return None
        if cut.extra != self.extra:
            logger.warning(
                "checkpoint of step %d: guard.extra changed after the evaluation began, so the loop went on "
                "past it; saved as it is now (stop right after the evaluation for an exact resume)",
                step,
            )
            return None
        return cut


@dataclass(frozen=True)
class Commit:
    """One checkpoint committed to one tier."""

    manifest: Manifest
    tier: str  # "local" (the fast first tier) or "durable"
    seconds: float
    uploaded: bool = False  # copied from the local tier (else serialised straight to this tier)
    synchronous: bool = False  # written while the loop waited (emergency, final, manual): its own rate
    #: A background write's own work (``DirectFile.work_seconds``): its time had it not shared the CPU with
    #: the training loop, the first emergency estimate's rate. None: not measured (an upload, a stream).
    work_s: float | None = None


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a resume restored, and the newest step already in durable storage."""

    step: int
    manifest: Manifest
    where: str
    seconds: float
    durable_step: int | None


#: The background part of a staged save; it stops early when the event is set (``SaveCancelled``).
Work = Callable[[threading.Event], None]
OnCommit = Callable[[Commit], None]


class Engine(Protocol):
    """Writes and reads checkpoints of the tracked state (``SingleEngine``, ``ShardedEngine``)."""

    #: Periodic saves go to a local tier first, then upload (the emergency estimate adds both).
    two_tiers: bool

    @property
    def staged_bytes(self) -> int:
        """Bytes held in the reused host buffers of staged saves."""

    @property
    def alloc_s(self) -> float:
        """Seconds the last snapshot spent allocating those buffers (a first save's, not the loop's cost)."""

    def reserve(self, tracked: Tracked) -> None:
        """Start allocating the buffers of periodic snapshots in the background (the first step after a start)."""

    def close(self) -> None:
        """Stop what ``reserve`` left running (the guard is closing); saves already staged are not affected."""

    def resume(self, tracked: Tracked) -> Resumed | None:
        """Restore the newest checkpoint that verifies into ``tracked`` (None: there is none)."""

    def save(
        self, tracked: Tracked, step: int, reason: str, *, deadline: float | None = None, final: bool = False
    ) -> Manifest | None:
        """Write ``step`` now, to the durable tier. None when it is committed already. ``final``: the
        state may have changed since a periodic save of the same step, which it then replaces."""

    def stage(self, tracked: Tracked, step: int, reason: str) -> Work:
        """Snapshot ``step`` into host buffers now; return the work that writes it."""


def copy_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """``guard.extra`` as it is now, whatever the loop sets while the checkpoint is written."""
    try:
        return copy.deepcopy(extra)
    except Exception:  # not JSON anyway: the manifest writer reports it from the save
        return dict(extra)
