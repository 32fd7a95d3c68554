"""Measured checkpoint costs: what the guard records.

``GuardStats`` is filled by the guard as it works (``guard.stats()``); the deadline logic of the
emergency save reasons with it. ``GuardStats.as_dict()`` is one record of the stats file that
``spotguard plan --stats`` reads (``spotguard.costs``, which has no torch, reads it; its names are
re-exported here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from spotguard.costs import DEFAULT_START_S, MeasuredCosts, load_stats

__all__ = ["DEFAULT_START_S", "GuardStats", "MeasuredCosts", "load_stats"]

_ALPHA = 0.5  # weight of the newest measurement in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else _ALPHA * new + (1 - _ALPHA) * old


@dataclass
class GuardStats:
    """Figures measured by the guard; rates are bytes per second, times are seconds."""

    async_save: bool = True  # periodic saves write in the background: only the snapshot stalls the loop
    checkpoints: int = 0
    skipped: int = 0
    failures: int = 0
    state_bytes: int | None = None
    snapshot_s: float | None = None  # moving average of the training-loop stall per async save
    last_stall_s: float | None = None
    write_s: float | None = None  # first tier (local_dir, or the durable URL without one)
    write_Bps: float | None = None
    work_Bps: float | None = None  # the same writes' rate without the waits for a CPU (``Commit.work_s``)
    upload_s: float | None = None  # local tier -> durable URL
    upload_Bps: float | None = None
    sync_s: float | None = None  # saves the loop waited for (emergency, final, manual): the emergency's rate
    sync_Bps: float | None = None
    emergency_s: float | None = None
    staging_budget: int | None = None  # host memory a snapshot may hold (``staging_budget``)
    pinned_bytes: int | None = None  # pinned host memory torch holds (CUDA only)
    alloc_s: float | None = None  # the last snapshot's allocation of staging buffers, apart from its stall
    restore_s: float | None = None
    notices: dict[str, int] = field(default_factory=dict)  # distinct notices seen, by kind

    def record_snapshot(self, seconds: float, nbytes: int) -> None:
        """``nbytes``: this process's snapshot. A guess of the state's size until a write measures it:
        in a process group a write counts every rank's files, as its rate does (see ``durable_seconds``)."""
        self.last_stall_s = seconds
        self.snapshot_s = _ema(self.snapshot_s, seconds)
        if self.write_s is None:
            self.state_bytes = nbytes

    def record_write(self, seconds: float, nbytes: int, work_s: float | None = None) -> None:
        self.write_s = _ema(self.write_s, seconds)
        self.write_Bps = _ema(self.write_Bps, nbytes / max(seconds, 1e-9))
        if work_s is not None:
            self.work_Bps = _ema(self.work_Bps, nbytes / max(work_s, 1e-9))
        self.state_bytes = nbytes

    def record_sync(self, seconds: float, nbytes: int) -> None:
        self.sync_s = _ema(self.sync_s, seconds)
        self.sync_Bps = _ema(self.sync_Bps, nbytes / max(seconds, 1e-9))
        self.state_bytes = nbytes

    def record_upload(self, seconds: float, nbytes: int) -> None:
        self.upload_s = _ema(self.upload_s, seconds)
        self.upload_Bps = _ema(self.upload_Bps, nbytes / max(seconds, 1e-9))

    def durable_seconds(self, nbytes: int | None = None, two_tiers: bool = False) -> float | None:
        """Estimated time of a synchronous save of ``nbytes`` to the durable tier (an emergency save).

        The measured rate of synchronous saves, once there is one; until then the background writes'
        (with two tiers the upload's, never the local disk's), counting only their own work where it was
        measured: a niced writer beside a busy loop waits for a CPU that a stopped loop leaves free
        (on our 2-core machine its wall time gave an estimate 4x the emergency's). Unmeasured is None.
        """
        nbytes = self.state_bytes if nbytes is None else nbytes
        rate = self.sync_Bps or (self.upload_Bps if two_tiers else self.work_Bps or self.write_Bps)
        if nbytes is None or not rate:
            return None
        return nbytes / rate

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures: one record of the stats file (``spotguard plan --stats``)."""
        figures = asdict(self)
        figures["async"] = figures.pop("async_save")
        return figures
