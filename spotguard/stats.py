"""The stats file ``spotguard plan --stats`` reads: measured checkpoint and restart costs.

Format: one JSON object, a JSON list of objects, or JSON lines (one object per checkpoint); values
are averaged. Keys, all optional, numbers or lists of numbers::

    {"snapshot_s": 1.2, "write_s": 8.5, "restart_s": 95.0, "state_bytes": 4.2e9, "async": false}

``snapshot_s``: the loop is blocked while the state is copied; ``write_s``: the storage write;
``restart_s``: process start to training again; ``async``: true when the write runs in the
background, so only the snapshot blocks the loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .planner import checked_number


@dataclass
class MeasuredCosts:
    """Costs read from a stats file (``load_stats``); None where the file does not say."""

    checkpoint_s: float | None
    restart_s: float | None
    state_gb: float | None


def load_stats(path: str | Path) -> MeasuredCosts:
    """Average the records; the checkpoint cost is ``snapshot_s + write_s`` (``snapshot_s`` when async)."""
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
        got = {k: _mean(p, k, rec[k]) for k in ("snapshot_s", "write_s", "restart_s", "state_bytes") if k in rec}
        if "snapshot_s" in got or "write_s" in got:
            write = 0.0 if rec.get("async") else got.get("write_s", 0.0)
            values["checkpoint"].append(got.get("snapshot_s", 0.0) + write)
        for k in ("restart_s", "state_bytes"):
            if k in got:
                values[k].append(got[k])
    avg = {k: (sum(v) / len(v) if v else None) for k, v in values.items()}
    if all(v is None for v in avg.values()):
        raise ConfigError(f"{p}: no snapshot_s, write_s, restart_s or state_bytes in it")
    gb = None if avg["state_bytes"] is None else avg["state_bytes"] / 1e9
    return MeasuredCosts(avg["checkpoint"], avg["restart_s"], gb)


def _mean(path: Path, key: str, value: object) -> float:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int | float) for v in items):
        raise ConfigError(f"{path}: {key} must be a number or a non-empty list of numbers, got {value!r}")
    return checked_number(f"{path}: {key}", sum(items) / len(items), zero=True)
