"""Measured costs for the planner: the stats file ``spotguard plan --stats`` reads.

Its records are ``json.dumps(guard.stats().as_dict())`` (``spotguard.guard.stats.GuardStats``): one
JSON object, a JSON list of objects, or JSON lines (one object per checkpoint); values are averaged.
Keys, all optional, numbers or lists of numbers (null: not measured; other keys are ignored)::

    {"snapshot_s": 1.2, "write_s": 8.5, "restart_s": 95.0, "restore_s": 4.0, "state_bytes": 4.2e9,
     "async": false}

``snapshot_s``: the loop is blocked while the state is copied; ``write_s``: the storage write;
``async``: true when the write runs in the background, so only the snapshot blocks the loop
(otherwise the write does). ``write_s`` (plus ``upload_s``, with a local tier) is also the time a
save takes to commit: the emergency save's, and the shortest useful interval. ``restart_s``: preemption to training again; without it,
``restore_s`` (what ``guard.resume()`` took) plus ``DEFAULT_START_S`` for the rest of a start.

No torch here: ``spotguard plan`` starts without it. ``read_records`` also reads the goodput
simulator's preemption traces.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.errors import ConfigError
from spotguard.planner import checked_number

#: Restart cost besides the restore when a record has only ``restore_s``: starting Python, torch,
#: CUDA and the data loaders. Waiting for a replacement machine is not in it: measure the whole
#: restart and give ``restart_s`` (or ``--restart-cost``) where that matters.
DEFAULT_START_S = 60.0


def read_records(
    path: str | Path, what: str, expected: str, parse_line: Callable[[str], Any] = json.loads
) -> list[Any]:
    """A user's file of records: one JSON document (a list is its records, anything else one record),
    or else one record per line, parsed by ``parse_line`` (blank lines and lines it maps to None are
    skipped). A file that cannot be read or parsed is a ``ConfigError`` naming ``what`` / ``expected``.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e}") from e
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        pass
    try:
        parsed = [parse_line(line) for line in text.splitlines() if line.strip()]
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{p}: not {expected} ({e})") from e
    return [r for r in parsed if r is not None]


@dataclass
class MeasuredCosts:
    """Costs read from a stats file (``load_stats``); None where the file does not say."""

    checkpoint_s: float | None
    restart_s: float | None
    state_gb: float | None
    save_s: float | None = None  # a durable commit: write_s, plus upload_s with a local tier


def load_stats(path: str | Path) -> MeasuredCosts:
    """Average the records: the checkpoint cost is ``snapshot_s`` when async, else ``snapshot_s +
    write_s``; the restart cost ``restart_s``, else ``restore_s + DEFAULT_START_S``."""
    p = Path(path)
    records = read_records(p, "stats file", "JSON or JSON lines")
    values: dict[str, list[float]] = {"checkpoint": [], "restart_s": [], "state_bytes": [], "save": []}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ConfigError(f"{p}: record {i + 1} is not a JSON object")
        got = {
            k: _mean(p, k, rec[k])
            for k in ("snapshot_s", "write_s", "upload_s", "restart_s", "restore_s", "state_bytes")
            if rec.get(k) is not None
        }
        blocking = ["snapshot_s"] if rec.get("async") else ["snapshot_s", "write_s"]
        if any(k in got for k in blocking):
            values["checkpoint"].append(sum(got.get(k, 0.0) for k in blocking))
        if "restart_s" in got or "restore_s" in got:
            values["restart_s"].append(got.get("restart_s", got.get("restore_s", 0.0) + DEFAULT_START_S))
        if "state_bytes" in got:
            values["state_bytes"].append(got["state_bytes"])
        if "write_s" in got:
            values["save"].append(got["write_s"] + got.get("upload_s", 0.0))
    avg = {k: (sum(v) / len(v) if v else None) for k, v in values.items()}
    if all(v is None for v in avg.values()):
        raise ConfigError(f"{p}: no snapshot_s, write_s, restart_s, restore_s or state_bytes in it")
    gb = None if avg["state_bytes"] is None else avg["state_bytes"] / 1e9
    return MeasuredCosts(avg["checkpoint"], avg["restart_s"], gb, avg["save"])


def _mean(path: Path, key: str, value: object) -> float:
    items = value if isinstance(value, list) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int | float) for v in items):
        raise ConfigError(f"{path}: {key} must be a number or a non-empty list of numbers, got {value!r}")
    return checked_number(f"{path}: {key}", sum(items) / len(items), zero=True)
