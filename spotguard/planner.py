"""How often to checkpoint: the goodput model behind ``spotguard plan`` and ``every_seconds="auto"``.

Checkpointing too often wastes I/O, too rarely wastes compute. With checkpoint cost C (seconds the
loop is blocked), restart cost R (preemption to training again) and mean time between failures M,
Young's interval is sqrt(2*C*M) and Daly's higher-order estimate refines it for C not << M.
Failures are a Poisson process in wall time (failures during a restart restart it). Under that
model the expected time to finish a segment of ``tau`` compute plus ``C`` checkpoint is
``M * e^(R/M) * (e^((tau+C)/M) - 1)`` (Daly 2006): R lowers goodput by e^(-R/M) but does not move
the optimum. A preemption that comes with a notice at least C seconds ahead loses (almost)
nothing: the emergency checkpoint saves it, so the periodic interval only has to cover the share
without notice (effective MTBF = M / share_without_notice).

What a noticed preemption costs depends on the guard's ``deadline_policy``. With ``"stop"`` the job
stops at the notice and the machine, paid until the deadline, idles for the whole lead. With
``"use-window"`` it commits the emergency checkpoint (``save_s``), trains on, and commits a second one
``window_reserve(save_s, margin)`` before the deadline: ``window_work`` of the lead is kept as
training, and only the two saves and the margin are idle. Either way the restart follows. The
periodic interval is never below ``save_s``: a save due before the previous one committed is skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError

logger = logging.getLogger(__name__)

#: Published notice lead times: AWS spot interruption 2 min, GCP preemption and Azure Preempt 30 s.
NOTICE_LEAD_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


def notice_lead(providers: Iterable[Any]) -> tuple[str, float] | None:
    """The shortest published notice of the clouds among ``providers`` (cloud, seconds), None for none."""
    leads = [(p.name, NOTICE_LEAD_S[p.name]) for p in providers if p.name in NOTICE_LEAD_S]
    return min(leads, key=lambda lead: lead[1]) if leads else None


#: When only ``notice_s`` is given: some preemptions (host failures, missed notices) come without one.
DEFAULT_NOTICE_SHARE = 0.9
#: When only ``notice_share`` is given: the shortest published lead (GCP, Azure).
DEFAULT_NOTICE_S = 30.0
DEFAULT_INTERVALS_S = (300.0, 900.0, 1800.0, 3600.0, 7200.0)
#: What a noticed preemption does after its emergency checkpoint (``Guard(deadline_policy=...)``).
DEADLINE_POLICIES = ("stop", "use-window")
#: ``"use-window"``: the second save may take this share longer than the first did.
WINDOW_SLACK = 0.25
#: ``"use-window"``: seconds kept free before the deadline beyond the save (``Guard(window_margin=...)``).
DEFAULT_WINDOW_MARGIN_S = 5.0


def window_reserve(save_s: float, margin_s: float = DEFAULT_WINDOW_MARGIN_S) -> float:
    """Seconds a notice window keeps free before the deadline for its second save: the measured save
    time, ``WINDOW_SLACK`` of it, and the margin. The guard (``spotguard.coordination.window``) uses the same rule."""
    return save_s * (1.0 + WINDOW_SLACK) + margin_s


def window_work(notice_s: float | None, save_s: float, margin_s: float = DEFAULT_WINDOW_MARGIN_S) -> float:
    """Seconds of a notice of ``notice_s`` that ``"use-window"`` spends training, and keeps: what is left
    after the emergency save and the reserve of the second one (0: the window does not open)."""
    if notice_s is None:
        return 0.0
    return max(notice_s - save_s - window_reserve(save_s, margin_s), 0.0)


def checked_number(name: str, value: object, *, zero: bool = False) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} must be a number, got {value!r}") from e
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise ConfigError(f"{name} must be {'>= 0' if zero else 'positive'} and finite, got {value!r}")
    return v


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): the first-order optimum sqrt(2*C*M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006): sqrt(2CM) * (1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M."""
    if math.isinf(mtbf_s):
        return math.inf
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - checkpoint_s


def _rates(mtbf_s: float, checkpoint_s: float, notice_share: float, notice_s: float | None) -> tuple[float, float]:
    """(total failure rate, rate of failures whose notice is long enough for an emergency save)."""
    lam = 1.0 / mtbf_s
    saved = notice_share if notice_s is not None and notice_s >= checkpoint_s else 0.0
    return lam, lam * saved


def _restart_time(lam: float, restart_s: float) -> float:
    """Expected wall time of a restart that failures keep interrupting, (e^(lam*R) - 1) / lam: infinite
    where that overflows (R hundreds of MTBFs), since such a restart is all but never completed."""
    try:
        return math.expm1(lam * restart_s) / lam
    except OverflowError:
        return math.inf


def goodput(
    interval_s: float,
    checkpoint_s: float,
    restart_s: float,
    mtbf_s: float,
    *,
    notice_share: float = 0.0,
    notice_s: float | None = None,
    window_s: float = 0.0,
) -> float:
    """Expected useful compute / wall time with a checkpoint after every ``interval_s`` of compute.

    Renewal over segment attempts: an attempt ends after ``interval_s + checkpoint_s`` or at the
    first failure. A failure without notice loses the attempt; one with a notice keeps the work
    done so far and costs the notice lead, of which ``window_s`` is spent training and kept
    (``window_work``; 0 with ``deadline_policy="stop"``). Either way a restart follows.
    """
    lam, lam_n = _rates(mtbf_s, checkpoint_s, notice_share, notice_s)
    s = interval_s + checkpoint_s
    fail = -math.expm1(-lam * s)  # P(failure within the attempt)
    restart = _restart_time(lam, restart_s)
    if math.isinf(restart) and fail > 0:  # every failure starts a restart that never completes
        return 0.0
    wall = fail / lam + fail * (restart + (lam_n / lam) * (notice_s or 0.0))
    kept_on_notice = -math.expm1(-lam * interval_s) / lam - interval_s * math.exp(-lam * s)
    window = min(window_s, notice_s or 0.0)
    useful = interval_s * math.exp(-lam * s) + (lam_n / lam) * (kept_on_notice + fail * window)
    return useful / wall


def lost_work(
    interval_s: float, checkpoint_s: float, mtbf_s: float, *, notice_share: float = 0.0, notice_s: float | None = None
) -> float:
    """Expected compute seconds to redo per preemption that hits training (noticed ones lose 0)."""
    lam, lam_n = _rates(mtbf_s, checkpoint_s, notice_share, notice_s)
    s = interval_s + checkpoint_s
    fail = -math.expm1(-lam * s)
    mean_progress = (-math.expm1(-lam * interval_s) / lam - interval_s * math.exp(-lam * s)) / fail
    return (1.0 - lam_n / lam) * mean_progress


def best_interval(f: Callable[[float], float], lo: float, hi: float, iters: int = 80) -> float:
    """Golden-section search for the maximum of a unimodal ``f`` on a log scale."""
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(iters):
        if fc > fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2.0)


@dataclass
class PlanOptions:
    """What the planner needs: measured costs, the failure rate and, optionally, the notices."""

    checkpoint_s: float
    restart_s: float
    mtbf_hours: float
    notice_s: float | None = None  # lead of a notice; None: no emergency checkpoints
    notice_share: float | None = None  # share of preemptions that come with that notice
    job_hours: float = 24.0  # only the "no checkpoints" figure depends on it
    state_gb: float | None = None  # to report checkpoint traffic
    intervals_s: Sequence[float] = DEFAULT_INTERVALS_S
    deadline_policy: str = "stop"  # "use-window": the notice lead is spent training (``window_work``)
    save_s: float | None = None  # seconds to commit one checkpoint durably; None: checkpoint_s
    window_margin_s: float = DEFAULT_WINDOW_MARGIN_S

    def __post_init__(self) -> None:
        self.checkpoint_s = checked_number("checkpoint cost (s)", self.checkpoint_s)
        self.restart_s = checked_number("restart cost (s)", self.restart_s, zero=True)
        self.mtbf_hours = checked_number("MTBF (hours)", self.mtbf_hours)
        self.job_hours = checked_number("job length (hours)", self.job_hours)
        if self.notice_s is not None or self.notice_share is not None:
            self.notice_s = checked_number(
                "notice lead (s)", DEFAULT_NOTICE_S if self.notice_s is None else self.notice_s
            )
            share = DEFAULT_NOTICE_SHARE if self.notice_share is None else self.notice_share
            share = checked_number("notice share", share, zero=True)
            if share > 1:
                raise ConfigError(f"notice share is a fraction in [0, 1], got {share!r}")
            self.notice_share = share
        if self.state_gb is not None:
            self.state_gb = checked_number("state size (GB)", self.state_gb, zero=True)
        self.intervals_s = tuple(checked_number("interval (s)", v) for v in self.intervals_s)
        if self.deadline_policy not in DEADLINE_POLICIES:
            raise ConfigError(f"deadline policy must be one of {DEADLINE_POLICIES}, got {self.deadline_policy!r}")
        self.save_s = self.checkpoint_s if self.save_s is None else checked_number("save time (s)", self.save_s)
        self.window_margin_s = checked_number("window margin (s)", self.window_margin_s, zero=True)

    @property
    def mtbf_s(self) -> float:
        return self.mtbf_hours * 3600.0

    @property
    def min_interval_s(self) -> float:
        """The shortest useful interval: a save due before the previous one committed is only skipped."""
        return max(self.save_s or 0.0, self.checkpoint_s)

    def window_s(self, policy: str | None = None) -> float:
        """Seconds of each noticed preemption's lead spent training and kept, under ``policy``."""
        if (policy or self.deadline_policy) != "use-window" or not self.notice_works:
            return 0.0
        return window_work(self.notice_s, self.save_s or self.checkpoint_s, self.window_margin_s)

    def idle_s(self, policy: str | None = None) -> float:
        """Paid seconds of each noticed preemption's lead not spent training (the restart comes on top)."""
        return (self.notice_s or 0.0) - self.window_s(policy)

    @property
    def notice_works(self) -> bool:
        """A notice helps only when its lead leaves time to write the emergency checkpoint (a durable
        write of ``save_s``; the loop's stall ``checkpoint_s`` when no save time is given)."""
        return self.notice_s is not None and self.notice_s >= max(self.checkpoint_s, self.save_s or 0.0)


@dataclass
class Row:
    """One strategy's expected figures."""

    name: str
    interval_s: float | None
    emergency: bool
    goodput: float
    lost_work_s: float
    checkpoints_per_hour: float
    write_gb_per_hour: float | None = None
    deadline_policy: str | None = None  # with emergency checkpoints: what the notice window is spent on


@dataclass
class Plan:
    """The recommendation (``interval_s``, ``goodput``) and the figures it is compared with."""

    options: PlanOptions
    interval_s: float
    goodput: float
    lost_work_s: float
    young_s: float
    daly_s: float
    optimum_s: float
    effective_mtbf_s: float
    rows: list[Row] = field(default_factory=list)
    window_s: float = 0.0  # seconds of each noticed preemption's lead trained and kept
    idle_s: float = 0.0  # paid seconds of each noticed preemption's lead not trained

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        opts = d.pop("options")
        opts["intervals_s"] = list(opts["intervals_s"])
        inf = math.isinf(self.effective_mtbf_s)
        d["effective_mtbf_s"] = None if inf else self.effective_mtbf_s
        d["young_s"] = None if inf else self.young_s
        d["daly_s"] = None if inf else self.daly_s
        return {"interval_s": d.pop("interval_s"), "goodput": d.pop("goodput"), **d, "options": opts}


def _row(o: PlanOptions, name: str, interval_s: float | None, emergency: bool, policy: str | None = None) -> Row:
    share, lead = (o.notice_share or 0.0, o.notice_s) if emergency and o.notice_works else (0.0, None)
    job_s = o.job_hours * 3600.0
    tau, cost = (job_s, 0.0) if interval_s is None else (interval_s, o.checkpoint_s)
    window = o.window_s(policy) if emergency else 0.0
    g = goodput(tau, cost, o.restart_s, o.mtbf_s, notice_share=share, notice_s=lead, window_s=window)
    lost = lost_work(tau, cost, o.mtbf_s, notice_share=share, notice_s=lead)
    per_hour = 0.0 if interval_s is None else 3600.0 * g / interval_s
    gb = None if o.state_gb is None else per_hour * o.state_gb
    return Row(name, interval_s, emergency, g, lost, per_hour, gb, (policy or o.deadline_policy) if emergency else None)


def plan(o: PlanOptions) -> Plan:
    """Recommend a periodic interval (Daly's estimate for the failures without a usable notice), never
    below ``min_interval_s``. With a notice, the last row is the guard's ``deadline_policy`` and the one
    before it the other policy, for comparison."""
    job_s = o.job_hours * 3600.0
    floor = min(o.min_interval_s, job_s)
    share = (o.notice_share or 0.0) if o.notice_works else 0.0
    eff = o.mtbf_s / (1.0 - share) if share < 1.0 else math.inf
    young, daly = young_interval(o.checkpoint_s, eff), daly_interval(o.checkpoint_s, eff)
    interval = max(min(daly, job_s), floor)
    window = o.window_s()
    optimum = best_interval(
        lambda t: goodput(
            t, o.checkpoint_s, o.restart_s, o.mtbf_s, notice_share=share, notice_s=o.notice_s, window_s=window
        ),
        max(floor, 1e-3),
        max(job_s, floor * 1.001),
    )
    rows = [_row(o, "no checkpoints", None, False)]
    rows += [_row(o, f"every {_fmt(t)}", t, False) for t in o.intervals_s]
    plain = max(min(daly_interval(o.checkpoint_s, o.mtbf_s), job_s), floor)
    rows.append(_row(o, "recommended (Young/Daly)", plain, False))
    if o.notice_s is not None:
        other = next(p for p in DEADLINE_POLICIES if p != o.deadline_policy)
        rows.append(_row(o, f"notice + rec. ({other})", interval, True, other))
        rows.append(_row(o, "notice + recommended", interval, True))
    best = rows[-1]
    return Plan(o, interval, best.goodput, best.lost_work_s, young, daly, optimum, eff, rows, window, o.idle_s())


def _fmt(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
