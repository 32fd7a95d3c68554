"""Measured checkpoint costs: what the guard records, and the stats file the planner reads.

``GuardStats`` is filled by the guard as it works (``guard.stats()``); the deadline logic of the
emergency save reasons with it. ``GuardStats.as_dict()`` is one record of the stats file that
``spotguard plan --stats`` reads. Its format: one JSON object, a JSON list of objects, or JSON lines
(one object per checkpoint); values are averaged. Keys, all optional, numbers or lists of numbers
(null: not measured; other keys are ignored)::

    {"snapshot_s": 1.2, "write_s": 8.5, "restart_s": 95.0, "restore_s": 4.0, "state_bytes": 4.2e9,
     "async": false}

``snapshot_s``: the loop is blocked while the state is copied; ``write_s``: the storage write;
``async``: true when the write runs in the background, so only the snapshot blocks the loop
(otherwise the write does). ``restart_s``: preemption to training again; without it,
``restore_s`` (what ``guard.resume()`` took) plus ``DEFAULT_START_S`` for the rest of a start.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spotguard.errors import ConfigError
from spotguard.planner import checked_number

_ALPHA = 0.5  # weight of the newest measurement in the moving averages
#: Restart cost besides the restore when a record has only ``restore_s``: starting Python, torch,
#: CUDA and the data loaders. Waiting for a replacement machine is not in it: measure the whole
#: restart and give ``restart_s`` (or ``--restart-cost``) where that matters.
DEFAULT_START_S = 60.0


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
    upload_s: float | None = None  # local tier -> durable URL
    upload_Bps: float | None = None
    emergency_s: float | None = None
    restore_s: float | None = None
    notices: dict[str, int] = field(default_factory=dict)  # distinct notices seen, by kind

    def record_snapshot(self, seconds: float, nbytes: int) -> None:
        """``nbytes``: this process's snapshot. A guess of the state's size until a write measures it:
        in a process group a write counts every rank's files, as its rate does (see ``durable_seconds``)."""
        self.last_stall_s = seconds
        self.snapshot_s = _ema(self.snapshot_s, seconds)
        if self.write_s is None:
            self.state_bytes = nbytes

    def record_write(self, seconds: float, nbytes: int) -> None:
        self.write_s = _ema(self.write_s, seconds)
        self.write_Bps = _ema(self.write_Bps, nbytes / max(seconds, 1e-9))
        self.state_bytes = nbytes

    def record_upload(self, seconds: float, nbytes: int) -> None:
        self.upload_s = _ema(self.upload_s, seconds)
        self.upload_Bps = _ema(self.upload_Bps, nbytes / max(seconds, 1e-9))

    def durable_seconds(self, nbytes: int | None = None, two_tiers: bool = False) -> float | None:
        """Estimated time to write ``nbytes`` straight to the durable tier, from its measured rate.

        With two tiers that is the upload rate, never the local disk's; unmeasured is None.
        """
        nbytes = self.state_bytes if nbytes is None else nbytes
        rate = self.upload_Bps if two_tiers else self.write_Bps
        if nbytes is None or not rate:
            return None
        return nbytes / rate

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures: one record of the stats file (``spotguard plan --stats``)."""
        figures = asdict(self)
        figures["async"] = figures.pop("async_save")
        return figures


@dataclass
class MeasuredCosts:
    """Costs read from a stats file (``load_stats``); None where the file does not say."""

    checkpoint_s: float | None
    restart_s: float | None
    state_gb: float | None


def load_stats(path: str | Path) -> MeasuredCosts:
    """Average the records: the checkpoint cost is ``snapshot_s`` when async, else ``snapshot_s +
    write_s``; the restart cost ``restart_s``, else ``restore_s + DEFAULT_START_S``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read stats file {p}: {e}") from e
    try:
        doc = json.loads(text)
        records = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not JSON or JSON lines ({e})") from e
    values: dict[str, list[float]] = {"checkpoint": [], "restart_s": [], "state_bytes": []}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ConfigError(f"{p}: record {i + 1} is not a JSON object")
        got = {k: _mean(p, k, rec[k]) for k in ("snapshot_s", "write_s", "restart_s", "restore_s", "state_bytes")
               if rec.get(k) is not None}
        blocking = ["snapshot_s"] if rec.get("async") else ["snapshot_s", "write_s"]
        if any(k in got for k in blocking):
            values["checkpoint"].append(sum(got.get(k, 0.0) for k in blocking))
        if "restart_s" in got or "restore_s" in got:
            values["restart_s"].append(got.get("restart_s", got.get("restore_s", 0.0) + DEFAULT_START_S))
        if "state_bytes" in got:
            values["state_bytes"].append(got["state_bytes"])
    avg = {k: (sum(v) / len(v) if v else None) for k, v in values.items()}
    if all(v is None for v in avg.values()):
        raise ConfigError(f"{p}: no snapshot_s, write_s, restart_s, restore_s or state_bytes in it")
    gb = None if avg["state_bytes"] is None else avg["state_bytes"] / 1e9
    return MeasuredCosts(avg["checkpoint"], avg["restart_s"], gb)


def _mean(path: Path, key: str, value: object) -> float:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int | float) for v in items):
        raise ConfigError(f"{path}: {key} must be a number or a non-empty list of numbers, got {value!r}")
    return checked_number(f"{path}: {key}", sum(items) / len(items), zero=True)
