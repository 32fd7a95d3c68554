"""Measured checkpoint costs: what the deadline logic and the interval planner reason with."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_ALPHA = 0.5  # weight of the newest measurement in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else _ALPHA * new + (1 - _ALPHA) * old


@dataclass
class GuardStats:
    """Figures measured by the guard; rates are bytes per second, times are seconds."""

    checkpoints: int = 0
    skipped: int = 0
    failures: int = 0
    state_bytes: int | None = None
    snapshot_s: float | None = None  # moving average of the training-loop stall per async save
    last_stall_s: float | None = None
    write_s: float | None = None  # first tier (local_dir, or the durable URL without one)
    write_Bps: float | None = None
    upload_s: float | None = None  # local tier -> durable URL
    upload_Bps: float | None = None
    emergency_s: float | None = None
    restore_s: float | None = None

    def record_snapshot(self, seconds: float, nbytes: int) -> None:
        self.last_stall_s = seconds
        self.snapshot_s = _ema(self.snapshot_s, seconds)
        self.state_bytes = nbytes

    def record_write(self, seconds: float, nbytes: int) -> None:
        self.write_s = _ema(self.write_s, seconds)
        self.write_Bps = _ema(self.write_Bps, nbytes / max(seconds, 1e-9))
        self.state_bytes = nbytes

    def record_upload(self, seconds: float, nbytes: int) -> None:
        self.upload_s = _ema(self.upload_s, seconds)
        self.upload_Bps = _ema(self.upload_Bps, nbytes / max(seconds, 1e-9))

    def durable_seconds(self, nbytes: int | None = None, two_tiers: bool = False) -> float | None:
        """Estimated time to write ``nbytes`` straight to the durable tier, from measured rates."""
        nbytes = self.state_bytes if nbytes is None else nbytes
        rate = (self.upload_Bps or self.write_Bps) if two_tiers else self.write_Bps
        if nbytes is None or not rate:
            return None
        return nbytes / rate

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures (``spotguard plan --stats`` reads these)."""
        return asdict(self)
