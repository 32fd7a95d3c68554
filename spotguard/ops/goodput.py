"""A Monte Carlo check of the planner: walk one job through a timeline of preemptions.

The job computes in segments of ``interval_s`` followed by a checkpoint of ``checkpoint_s``. A
preemption without notice loses everything since the last checkpoint; one with a notice at least
``checkpoint_s`` ahead (leads per cloud: AWS 120 s, GCP and Azure 30 s) is saved by an emergency
checkpoint, after which the job exits and waits for the machine to go (``deadline_policy="stop"``) or
first trains ``window_s`` seconds of the lead and keeps them (``"use-window"``). Each preemption is
followed by ``restart_s`` of restart, and a preemption during a restart starts it over. Preemptions come
from an exponential process (mean ``mtbf_hours``) or a trace of times. Randomness comes from a
private ``numpy.random.Generator``: the global streams are never touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spotguard.costs import read_records
from spotguard.errors import ConfigError
from spotguard.planner import NOTICE_LEAD_S, checked_number


@dataclass
class SimOptions:
    """One simulated job. ``interval_s=None`` means no periodic checkpoints."""

    checkpoint_s: float
    restart_s: float
    interval_s: float | None
    job_hours: float = 1000.0
    mtbf_hours: float | None = None  # exponential preemptions; or give ``trace``
    trace: Sequence[float] | None = None  # preemption times, seconds of wall time from the start
    notice_share: float = 0.0  # share of preemptions that come with a notice
    cloud: str | None = None  # picks the notice lead: aws 120 s, gcp/azure 30 s
    notice_s: float | None = None  # the lead itself (overrides ``cloud``)
    emergency: bool = True  # write an emergency checkpoint on a notice
    window_s: float = 0.0  # seconds of each notice's lead trained and kept ("use-window"; planner.window_work)
    runs: int = 1  # independent jobs (a trace is replayed for each)
    seed: int | None = None

    def __post_init__(self) -> None:
        self.checkpoint_s = checked_number("checkpoint cost (s)", self.checkpoint_s, zero=True)
        self.restart_s = checked_number("restart cost (s)", self.restart_s, zero=True)
        self.job_hours = checked_number("job length (hours)", self.job_hours)
        if self.interval_s is not None:
            self.interval_s = checked_number("interval (s)", self.interval_s)
        if (self.mtbf_hours is None) == (self.trace is None):
            raise ConfigError("give exactly one preemption process: mtbf_hours or a trace")
        if self.mtbf_hours is not None:
            self.mtbf_hours = checked_number("MTBF (hours)", self.mtbf_hours)
        if self.trace is not None:
            self.trace = sorted(checked_number("preemption time (s)", t, zero=True) for t in self.trace)
        if not 0.0 <= float(self.notice_share) <= 1.0:
            raise ConfigError(f"notice_share is a fraction in [0, 1], got {self.notice_share!r}")
        if self.cloud is not None and self.cloud not in NOTICE_LEAD_S:
            raise ConfigError(f"unknown cloud {self.cloud!r}; expected one of {', '.join(NOTICE_LEAD_S)}")
        if self.notice_s is None:
            self.notice_s = NOTICE_LEAD_S[self.cloud] if self.cloud else 0.0
        self.notice_s = checked_number("notice lead (s)", self.notice_s, zero=True)
        self.window_s = checked_number("notice window trained (s)", self.window_s, zero=True)
        if not isinstance(self.runs, int) or self.runs < 1:
            raise ConfigError(f"runs must be an int >= 1, got {self.runs!r}")


@dataclass
class SimResult:
    goodput: float  # useful compute / wall time
    wall_s: float
    work_s: float
    preemptions: int  # preemptions that hit training (not a restart)
    saved_by_notice: int  # of those, saved by an emergency checkpoint
    lost_work_s: float  # mean compute lost per preemption that hit training
    checkpoints: int


def load_trace(path: str | Path) -> list[float]:
    """Preemption times in seconds: a JSON list, or one number per line ('#' starts a comment)."""
    values = read_records(path, "trace", "a preemption trace", _trace_line)
    try:
        return [checked_number("preemption time (s)", v, zero=True) for v in values]
    except ValueError as e:
        raise ConfigError(f"{path}: not a preemption trace ({e})") from e


def _trace_line(line: str) -> float | None:
    code = line.split("#")[0]
    return float(code) if code.strip() else None


def _preemptions(o: SimOptions, rng: np.random.Generator) -> Iterator[tuple[float, bool]]:
    """(time, comes with a notice) in time order; ends with (inf, False) forever."""
    if o.trace is not None:
        for t in o.trace:
            yield t, bool(rng.random() < o.notice_share)
    else:
        assert o.mtbf_hours is not None
        t = 0.0
        while True:
            gaps = rng.exponential(o.mtbf_hours * 3600.0, size=512)
            noticed = rng.random(512) < o.notice_share
            for gap, n in zip(gaps.tolist(), noticed.tolist(), strict=True):
                t += gap
                yield t, n
    while True:
        yield math.inf, False


def simulate(o: SimOptions) -> SimResult:
    """Run ``runs`` jobs to completion; goodput is their total work over their total wall time."""
    rng = np.random.default_rng(o.seed)
    runs = [_run(o, rng) for _ in range(o.runs)]
    wall, work = sum(r.wall_s for r in runs), sum(r.work_s for r in runs)
    hits = sum(r.preemptions for r in runs)
    lost = sum(r.lost_work_s * r.preemptions for r in runs)
    return SimResult(
        work / wall,
        wall,
        work,
        hits,
        sum(r.saved_by_notice for r in runs),
        lost / hits if hits else 0.0,
        sum(r.checkpoints for r in runs),
    )


def _run(o: SimOptions, rng: np.random.Generator) -> SimResult:
    events = _preemptions(o, rng)
    job_s = o.job_hours * 3600.0
    c, lead = o.checkpoint_s, o.notice_s or 0.0
    notice_saves = o.emergency and lead >= c
    t = done = lost_total = 0.0
    hits = saved = checkpoints = 0
    p, noticed = next(events)
    while done < job_s:
        work = min(o.interval_s or math.inf, job_s - done)
        last = done + work >= job_s
        end = t + work + (0.0 if last else c)  # the last segment needs no checkpoint
        warned = noticed and notice_saves
        event_at = p - lead if warned else p  # the job acts on the notice, not the kill
        if event_at >= end:
            t, done = end, done + work
            checkpoints += not last
            continue
        hits += 1
        if warned:
            saved += 1
            done += min(max(event_at - t, 0.0), work)  # emergency save (or the periodic one finishes)
            done = min(done + min(o.window_s, lead), job_s)  # the notice window, trained and kept
        else:
            lost_total += min(p - t, work)
        t = p
        p, noticed = next(events)
        while p < t + o.restart_s:  # preempted while restarting: start over
            t = p
            p, noticed = next(events)
        t += o.restart_s
    return SimResult(job_s / t, t, job_s, hits, saved, lost_total / hits if hits else 0.0, checkpoints)
