"""What a rehearsal measured: per preemption, and the goodput beside the planner's prediction.

Read only from spotguard's own records: the heartbeat's steps as the fleet saw them (every job has
one, trainer integrations included), the Guard's JSON lines events where the job has a Guard
(notice, checkpoint, stop, resume), and the manifests in the storage. Times are the fleet's clock.

Goodput is useful training time over wall time, from the first step of the first machine to the last
step of the last: useful is each machine's span of steps, less its periodic checkpoint stalls and
the steps the next machine redoes. The planner is given the same costs: the measured stall per
periodic checkpoint and the interval between them, the restart (a machine's end to the next one's
first step), the notice window as it was spent (the last step to the job's exit), and the mean
training time between preemptions as it came out (the draws are random; the mean asked for is
shown beside it). The planner lets restarts be preempted, a rehearsal does not: it is given the
restart cost whose expected length under its model is the restart measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from spotguard import planner

from .fleet import Machine


@dataclass
class Preemption:
    """One noticed preemption; times in seconds, None where not measured."""

    index: int
    machine: int
    after_restart: bool  # sent within the first seconds after a start
    landed: str | None  # what the job was doing at the notice: step, save, evaluation, startup
    stop_step: int  # the machine's last step
    detection_s: float | None  # notice -> the job saw it (its Guard's notice event, else its stop flag)
    save_s: float | None  # the emergency checkpoint (the Guard's stop event)
    committed: bool | None  # the machine's last step is the resume point (None: no storage to look at)
    steps_lost: int | None  # steps done on the machine after the newest checkpoint
    teardown_s: float | None  # the last commit -> the job's processes all exited
    idle_s: float | None  # the last commit -> the notice's deadline (or its approval, Azure): paid, unused
    killed: bool  # still running at the deadline
    restart_s: float | None  # the job gone -> the next machine's first step
    resume_s: float | None  # the next machine's start -> its Guard resumed
    restore_s: float | None  # of which the checkpoint load
    steps_replayed: int | None  # steps the next machine did again


@dataclass
class Report:
    preemptions: list[Preemption]
    machines: int
    steps: int
    wall_s: float  # first step -> last step
    end_to_end_s: float  # first start -> last exit
    useful_s: float
    goodput: float | None
    planner_goodput: float | None  # for the measured costs and the realised time between preemptions
    planner_goodput_asked: float | None  # the same, at the mean time between preemptions asked for
    costs: dict[str, float | None]
    cpu_job_s: float = 0.0
    cpu_self_s: float = 0.0
    error: str | None = None

    @property
    def all_committed(self) -> bool:
        return all(p.committed for p in self.preemptions)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["all_committed"] = self.all_committed
        d["overhead"] = self.cpu_self_s / self.cpu_job_s if self.cpu_job_s else None
        return d


def _events(m: Machine, name: str) -> list[dict[str, Any]]:
    return [e for e in m.events if e.get("event") == name]


def _first(m: Machine, name: str) -> dict[str, Any] | None:
    found = _events(m, name)
    return found[0] if found else None


def _stalls(m: Machine) -> list[float]:
    """The loop's stall per periodic checkpoint: the snapshot for a background save, else the write."""
    out, seen = [], set()
    for e in _events(m, "checkpoint"):
        if e.get("reason") not in ("periodic", "advisory") or e.get("step") in seen:
            continue
        seen.add(e.get("step"))
        stall = e.get("last_stall_s") if e.get("async") else e.get("seconds")
        if isinstance(stall, int | float):
            out.append(float(stall))
    return out


def _resume_step(m: Machine, previous: Machine | None) -> int | None:
    ev = _first(m, "resume")
    if ev is not None:
        return int(ev.get("step") or 0)
    if previous is not None and previous.storage_read:
        return previous.latest_step or 0
    return m.timeline[0][1] - 1 if m.timeline else None


def _reached(m: Machine, step: int) -> float | None:
    for t, s in m.timeline:
        if s >= step:
            return t
    return None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def measure(
    machines: list[Machine], lead_s: float, mtbf_asked_s: float | None, has_storage: bool, error: str | None = None
) -> Report:
    pre: list[Preemption] = []
    useful = exposure = 0.0
    stalls: list[float] = []
    periodic = 0
    windows: list[float] = []
    for i, m in enumerate(machines):
        nxt = machines[i + 1] if i + 1 < len(machines) else None
        t_stop = m.timeline[-1][0] if m.timeline else None
        replay_s = 0.0
        resumed_next = _resume_step(nxt, m) if nxt is not None else None
        if m.first_step is not None and t_stop is not None:
            if resumed_next is not None and resumed_next < m.last_step:
                replay_s = t_stop - (_reached(m, resumed_next + 1) or t_stop)
            own = _stalls(m)
            stalls += own
            periodic += len(own)
            useful += max(t_stop - m.first_step - sum(own) - replay_s, 0.0)
            exposure += t_stop - m.first_step
        if not m.preempted:  # no notice, or the job finished before it took effect
            continue
        assert m.notice is not None and m.deadline is not None
        notice_ev, stop_ev = _first(m, "notice"), _first(m, "stop")
        seen = notice_ev["unix"] if notice_ev else m.stopped_flag
        commit = m.latest_time if has_storage else (stop_ev["unix"] if stop_ev else None)
        committed: bool | None
        lost: int | None
        if has_storage:
            lost = max(m.last_step - (m.latest_step or 0), 0)
            committed = lost == 0 and m.latest_step is not None
        else:
            lost = stop_ev.get("lost_steps") if stop_ev else None
            committed = bool(stop_ev.get("committed")) if stop_ev else None
        resume_ev = _first(nxt, "resume") if nxt else None
        fresh = commit is not None and commit >= m.start  # a commit of this machine, not an older one
        # An approved notice (Azure's StartRequests) lets the cloud take the machine at once: paid until then.
        gone = m.deadline if m.approved is None else min(m.approved, m.deadline)
        windows.append(m.end - (t_stop if t_stop is not None and t_stop >= m.notice else m.notice))
        pre.append(
            Preemption(
                index=len(pre) + 1,
                machine=m.index,
                after_restart=bool(m.planned and m.planned.restart),
                landed=m.landed,
                stop_step=m.last_step,
                detection_s=None if seen is None else seen - m.notice,
                save_s=stop_ev.get("seconds") if stop_ev else None,
                committed=committed,
                steps_lost=lost,
                teardown_s=m.end - commit if fresh and commit is not None and not m.killed else None,
                idle_s=max(gone - commit, 0.0) if fresh and commit is not None else None,
                killed=m.killed,
                restart_s=None if nxt is None or nxt.first_step is None else nxt.first_step - m.end,
                resume_s=None if resume_ev is None or nxt is None else resume_ev["unix"] - nxt.start,
                restore_s=resume_ev.get("restore_s") if resume_ev else None,
                steps_replayed=None if resumed_next is None else max(m.last_step - resumed_next, 0),
            )
        )
    firsts = [m.first_step for m in machines if m.first_step is not None]
    lasts = [m.timeline[-1][0] for m in machines if m.timeline]
    wall = (lasts[-1] - firsts[0]) if firsts and lasts else 0.0
    restart = _mean([p.restart_s for p in pre if p.restart_s is not None])
    costs: dict[str, float | None] = {
        "checkpoint_s": _mean(stalls) or 0.0,
        "interval_s": useful / periodic if periodic else useful,
        "restart_s": restart,
        "window_s": _mean(windows),
        "lead_s": lead_s,
        "mtbf_s": exposure / len(pre) if pre else None,
        "mtbf_asked_s": mtbf_asked_s,
    }
    return Report(
        preemptions=pre,
        machines=len(machines),
        steps=machines[-1].last_step if machines else 0,
        wall_s=wall,
        end_to_end_s=(machines[-1].end - machines[0].start) if machines else 0.0,
        useful_s=useful,
        goodput=useful / wall if wall > 0 else None,
        planner_goodput=_predict(costs, costs["mtbf_s"]),
        planner_goodput_asked=_predict(costs, mtbf_asked_s),
        costs=costs,
        cpu_job_s=sum(m.cpu_s for m in machines),
        error=error,
    )


def _predict(costs: dict[str, float | None], mtbf_s: float | None) -> float | None:
    """``planner.goodput`` for these costs; every preemption of a rehearsal comes with a notice.

    The planner lets a restart be preempted too (its expected length is ``expm1(R/M) * M``); a
    rehearsal's notices come only while the job trains. So the planner is given the restart cost
    whose expected length under its model is the restart measured: ``M * log1p(R/M)``.
    """
    interval, restart, window = costs["interval_s"], costs["restart_s"], costs["window_s"]
    if not mtbf_s or not interval or restart is None or window is None:
        return None
    try:
        return planner.goodput(
            interval,
            costs["checkpoint_s"] or 0.0,
            mtbf_s * math.log1p(restart / mtbf_s),
            mtbf_s,
            notice_share=1.0,
            notice_s=max(window, 0.0),
        )
    except (ValueError, OverflowError, ZeroDivisionError):
        return None


# -- text ----------------------------------------------------------------------------------------
def _s(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.2f}s"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(r: Report) -> str:
    """The report as text: one row per preemption, then the totals and the planner beside them."""
    head = (
        f"{'#':>2} {'STEP':>6} {'LANDED':>10} {'DETECT':>7} {'SAVE':>7} {'COMMITTED':>9} {'LOST':>5} {'TEARDOWN':>9} "
    )
    head += f"{'IDLE':>8} {'RESTART':>8} {'RESUME':>7} {'REPLAYED':>8}"
    rows = [head]
    for p in r.preemptions:
        committed = "?" if p.committed is None else ("yes" if p.committed else "NO")
        if p.killed:
            committed += " (killed)"
        rows.append(
            f"{p.index:>2} {p.stop_step:>6} {p.landed or '?':>10} {_s(p.detection_s):>7} {_s(p.save_s):>7} {committed:>9} "
            f"{'-' if p.steps_lost is None else p.steps_lost:>5} {_s(p.teardown_s):>9} {_s(p.idle_s):>8} "
            f"{_s(p.restart_s):>8} {_s(p.resume_s):>7} {'-' if p.steps_replayed is None else p.steps_replayed:>8}"
            + ("  (after a restart)" if p.after_restart else "")
        )
    c = r.costs
    teardown = [p.teardown_s for p in r.preemptions if p.teardown_s is not None]
    idle = [p.idle_s for p in r.preemptions if p.idle_s is not None]
    rows += [
        "",
        f"preemptions {len(r.preemptions)} on {r.machines} machines, {r.steps} steps; "
        f"every emergency checkpoint committed: {'yes' if r.all_committed else 'NO'}",
        f"teardown after the last commit: mean {_s(_mean(teardown))}",
        f"idle window after the stop (last commit -> deadline or approval, of a {c['lead_s']:g}s notice): "
        f"mean {_s(_mean(idle))}",
        f"useful training {_s(r.useful_s)} of {_s(r.wall_s)} (first step -> last step; {_s(r.end_to_end_s)} "
        f"start to end): goodput {_pct(r.goodput)}",
        f"planner, same costs (checkpoint {_s(c['checkpoint_s'])} every {_s(c['interval_s'])}, restart "
        f"{_s(c['restart_s'])}, window {_s(c['window_s'])}): {_pct(r.planner_goodput)} at the realised "
        f"{_s(c['mtbf_s'])} between preemptions, {_pct(r.planner_goodput_asked)} at the {_s(c['mtbf_asked_s'])} asked",
    ]
    if r.cpu_job_s:
        rows.append(
            f"rehearse's own CPU (mock server, monitoring) {r.cpu_self_s:.2f}s = "
            f"{100 * r.cpu_self_s / r.cpu_job_s:.2f}% of the job's {r.cpu_job_s:.1f}s"
        )
    if r.error:
        rows.append(f"error: {r.error}")
    return "\n".join(rows)
