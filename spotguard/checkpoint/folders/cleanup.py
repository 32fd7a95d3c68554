"""What ``spotguard rm --incomplete`` may delete: the garbage of killed saves, and nothing else.

Garbage is, in a run's storage root only: ``step-N/`` folders without a manifest (incomplete),
checkpoints whose manifest names a missing file or one of another size (``broken``: corrupt for
good), and what the backend reports among its own in-flight names (``Storage.leftovers``: temp
files, scratch folders, unfinished multipart uploads, composite-upload parts). Nothing else is
looked at: a name another program wrote is never a candidate.

A candidate that may still belong to a save in flight is skipped, and the plan says why:

1. the run holds a live lease (``lease.read(storage).live()``): everything is skipped;
2. it changed less than ``min_age_s`` ago, a ``step-N/`` folder counting its newest object and
   leftover (a run without a lease, an older spotguard, still gets this protection);
3. its age is unknown (a backend without ``list_times``);
4. its name records a writer process still running on this host (local storage).

``plan`` finds and judges; ``remove`` deletes what the plan calls garbage (a broken checkpoint's
manifest first, as ``retention.delete`` always does), after judging it again at that moment: between the
two a job may have taken the lease and committed the step a killed save left, so a candidate is kept
when the lease record changed since the plan, when its folder now holds a manifest (or is no longer
broken), or when it changed less than ``min_age_s`` ago. An incomplete folder's removal never deletes
a manifest.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from spotguard.checkpoint import lease
from spotguard.checkpoint.folders.retention import delete
from spotguard.checkpoint.format.manifest import MANIFEST, human_duration, parse_step_dir
from spotguard.checkpoint.format.reader import scan, scan_one
from spotguard.errors import ConfigError
from spotguard.storage.base import Leftover, Storage
from spotguard.storage.local_leftovers import writer_running

logger = logging.getLogger(__name__)

#: Younger than this, a candidate may be a running save's (a big upload takes minutes, not an hour).
DEFAULT_MIN_AGE_S = 3600.0


@dataclass(frozen=True)
class Candidate:
    """One piece of garbage, or something that looks like it."""

    name: str  # ``step-N`` for a checkpoint folder, else the leftover's key
    kind: str  # "incomplete", "broken", or the leftover's kind ("temp file", "multipart upload" ...)
    age_s: float | None  # since its last change; None when the backend cannot tell
    size: int | None = None  # bytes, where known
    problem: str = ""  # why a checkpoint folder is garbage
    leftover: Leftover | None = None

    @property
    def step(self) -> int | None:
        return parse_step_dir(self.name.partition("/")[0])


@dataclass
class Plan:
    """What ``remove`` will delete, and what was spared and why (candidate, reason)."""

    garbage: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[Candidate, str]] = field(default_factory=list)
    live_lease: lease.LeaseRecord | None = None  # the live lease that spared everything, if any
    min_age_s: float = DEFAULT_MIN_AGE_S
    lease_token: str | None = None  # the version of the lease record the plan saw (None: there was none)
    clock_offset: float = 0.0  # ``now`` given to ``plan`` minus the time then: ``remove`` judges on that clock


def plan(storage: Storage, min_age_s: float = DEFAULT_MIN_AGE_S, *, now: float | None = None) -> Plan:
    """Find the garbage under ``storage`` and sort it into what may go and what is skipped.

    A lease record that cannot be parsed raises ``CheckpointCorruptError``: with no way to tell
    whether a run is writing, nothing is judged.
    """
    if isinstance(min_age_s, bool) or not isinstance(min_age_s, (int, float)) or not math.isfinite(min_age_s):
        raise ConfigError(f"min_age_s must be a finite number of seconds, got {min_age_s!r}")
    if min_age_s < 0:
        raise ConfigError(f"min_age_s must be at least 0, got {min_age_s}")
    now = time.time() if now is None else now
    record, token = lease.read_versioned(storage)
    leftovers = storage.leftovers()
    infos = scan(storage)
    changed = _folder_changes(storage.list_times(""), leftovers)
    found = []
    for info in infos:
        if info.status == "incomplete" or info.broken:
            kind = "incomplete" if info.status == "incomplete" else "broken"
            found.append(Candidate(info.name, kind, _age(now, changed.get(info.name)), problem=info.problem))
    for item in leftovers:
        top = item.key.partition("/")[0]
        newest = max(item.modified, changed.get(top, item.modified))  # a live save's folder keeps its parts
        found.append(Candidate(item.key, item.kind, _age(now, newest), item.size, leftover=item))
    live = record if record is not None and record.live(now) else None
    offset = now - time.time()
    result = Plan(live_lease=live, min_age_s=float(min_age_s), lease_token=token, clock_offset=offset)
    for c in found:
        why = _why_kept(c, result.live_lease, min_age_s, now)
        if why:
            result.skipped.append((c, why))
        else:
            result.garbage.append(c)
    return result


def remove(storage: Storage, candidate: Candidate, found: Plan) -> str:
    """Delete one piece of garbage of the plan ``found``, judged again now (module docstring); returns
    why it was kept after all, or "" when it was deleted."""
    why, keys = _judge_again(storage, candidate, found)
    if why:
        logger.info("kept %s: %s", storage.describe(candidate.name), why)
        return why
    if candidate.leftover is not None:
        storage.remove_leftover(candidate.leftover)
    elif candidate.kind == "incomplete":
        storage.delete([k for k in keys if k != f"{candidate.name}/{MANIFEST}"])  # listed just now: none
    else:
        delete(storage, candidate.name)
    logger.info("removed %s (%s)", storage.describe(candidate.name), candidate.kind)
    return ""


def _judge_again(storage: Storage, c: Candidate, found: Plan) -> tuple[str, list[str]]:
    """Why ``c`` must stay after all, judged at removal time, and the keys of its folder as listed now."""
    now = time.time() + found.clock_offset
    record, token = lease.read_versioned(storage)
    if token != found.lease_token:
        held = f" ({record.describe(now)})" if record is not None else ""
        return f"the writer lease changed since the plan{held}: a job may be writing", []
    if record is not None and record.live(now):
        return f"the run holds a live lease ({record.describe(now)})", []
    folder = c.name.partition("/")[0]
    times = storage.list_times(folder + "/")
    if times and now - max(times.values()) < found.min_age_s:
        ago = human_duration(max(now - max(times.values()), 0.0))  # the clocks of two calls: never "-0s"
        return f"{folder} changed {ago} ago, since the plan: a save may be writing it", []
    if c.leftover is None and f"{folder}/{MANIFEST}" in times:
        if c.kind == "incomplete":
            return "it holds a manifest now: committed since the plan", []
        info = scan_one(storage, folder)
        if info is None or not info.broken:
            return f"it is {info.status if info else 'gone'} now, no longer broken", []
    return "", sorted(times)


def _folder_changes(times: dict[str, float], leftovers: list[Leftover]) -> dict[str, float]:
    """The newest change in each top-level folder, its objects and its leftovers counted."""
    newest: dict[str, float] = {}
    for key, t in [*times.items(), *((item.key, item.modified) for item in leftovers)]:
        top = key.partition("/")[0]
        newest[top] = max(t, newest.get(top, t))
    return newest


def _age(now: float, changed: float | None) -> float | None:
    return None if changed is None else max(0.0, now - changed)


def _why_kept(c: Candidate, live: lease.LeaseRecord | None, min_age_s: float, now: float) -> str:
    """Why ``c`` must stay, or "" when it may go."""
    if live is not None:
        return f"the run holds a live lease ({live.describe(now)})"
    if c.age_s is None:
        return "its age is unknown (this storage reports no modification times)"
    if c.age_s < min_age_s:
        return (
            f"changed {human_duration(c.age_s)} ago, less than the minimum age {_span(min_age_s)}: "
            "a save may still be writing it"
        )
    owner = c.leftover.owner if c.leftover is not None else ""
    if owner and writer_running(owner):
        return f"its writer ({owner}) is still running on this host"
    return ""


def _span(seconds: float) -> str:
    """The minimum age as given: ``1 h``, ``30 min``, ``90 s``."""
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale and seconds % scale == 0:
            return f"{seconds / scale:g} {unit}"
    return f"{seconds:g} s"
