"""The rehearsal's arithmetic on machines described by hand: goodput, costs, lost and replayed steps.

The processes are run for real in tests/ops/test_rehearse.py; here the figures are checked against
values worked out on paper, including the cases a real run rarely hits (a replay, a missing event).
"""

from __future__ import annotations

import math

import pytest

from spotguard import heartbeat
from spotguard.errors import ConfigError
from spotguard.ops.rehearsal import RehearsalOptions
from spotguard.ops.rehearsal.fleet import Machine, Planned, landed, plan_notices
from spotguard.ops.rehearsal.report import measure
from spotguard.planner import goodput


def machines(*, latest: int = 100, resumed: int = 100) -> list[Machine]:
    """Machine 1 trains steps 1..100 from t=10 to t=20 (periodic stalls of 0.5 s at steps 40 and 80),
    is noticed at t=19.5 (deadline t=49.5), commits at t=20.5 and is gone at t=22; machine 2 starts
    at t=23, makes its first step at t=30 and finishes at t=40."""
    m1 = Machine(1, start=0.0, end=22.0, code=75, notice=19.5, deadline=49.5, planned=Planned(9.5))
    m1.timeline = [(10.0 + i * 0.1, i + 1) for i in range(100)]
    m1.timeline[-1] = (20.0, 100)
    m1.latest_step, m1.latest_time, m1.storage_read = latest, 20.5, True
    m1.events = [
        {"event": "checkpoint", "reason": "periodic", "step": s, "async": True, "last_stall_s": 0.5} for s in (40, 80)
    ] + [
        {"event": "notice", "unix": 19.6},
        {"event": "stop", "unix": 20.5, "seconds": 0.4, "step": 100, "committed": latest == 100},
    ]
    m2 = Machine(2, start=23.0, end=41.0, code=0)
    m2.timeline = [(30.0, resumed + 1), (40.0, 200)]
    m2.events = [{"event": "resume", "unix": 27.0, "step": resumed, "restore_s": 0.3}]
    return [m1, m2]


def test_a_committed_preemption_costs_its_window_and_restart_only():
    r = measure(machines(), lead_s=30.0, mtbf_asked_s=10.0, has_storage=True)
    (p,) = r.preemptions
    assert (p.committed, p.steps_lost, p.steps_replayed, p.stop_step) == (True, 0, 0, 100)
    assert p.detection_s == pytest.approx(0.1) and p.save_s == 0.4
    assert p.teardown_s == pytest.approx(1.5) and p.idle_s == pytest.approx(29.0)
    assert p.restart_s == pytest.approx(8.0) and p.resume_s == pytest.approx(4.0) and p.restore_s == 0.3
    assert r.wall_s == pytest.approx(30.0) and r.useful_s == pytest.approx(19.0)  # 10 - 2 stalls + 10
    assert r.goodput == pytest.approx(19.0 / 30.0)
    c = r.costs
    assert c["checkpoint_s"] == 0.5 and c["interval_s"] == pytest.approx(19.0 / 2)
    assert c["window_s"] == pytest.approx(2.0) and c["mtbf_s"] == pytest.approx(20.0)
    # The restart whose expected length is 8 s where restarts can be preempted too (the planner's model).
    expected = goodput(19.0 / 2, 0.5, 20.0 * math.log1p(8.0 / 20.0), 20.0, notice_share=1.0, notice_s=2.0)
    assert r.planner_goodput == pytest.approx(expected)
    assert r.all_committed


def test_steps_after_the_resume_point_are_lost_and_their_time_is_not_useful():
    r = measure(machines(latest=80, resumed=80), lead_s=30.0, mtbf_asked_s=None, has_storage=True)
    (p,) = r.preemptions
    assert (p.committed, p.steps_lost, p.steps_replayed) == (False, 20, 20)
    # Machine 1 reached step 81 at t=18.0: its last 2 s were redone.
    assert r.useful_s == pytest.approx(19.0 - 2.0) and not r.all_committed


def test_without_a_guard_the_heartbeat_and_manifests_still_tell():
    ms = machines()
    ms[0].events, ms[1].events = [], []
    ms[0].stopped_flag = 19.8
    r = measure(ms, lead_s=30.0, mtbf_asked_s=None, has_storage=True)
    (p,) = r.preemptions
    assert p.detection_s == pytest.approx(0.3) and p.save_s is None and p.resume_s is None
    assert p.committed and p.steps_replayed == 0  # the next machine resumed from the committed step
    assert r.useful_s == pytest.approx(20.0)  # no events: no stalls known


def test_a_job_that_finished_before_its_notice_is_no_preemption():
    ms = machines()
    ms[1].planned, ms[1].notice, ms[1].deadline = Planned(50.0), 39.0, 69.0
    r = measure(ms, lead_s=30.0, mtbf_asked_s=None, has_storage=True)
    assert len(r.preemptions) == 1


def test_notice_moments_come_from_the_seed():
    o = RehearsalOptions(["true"], preemptions=6, mtbf_s=2.0, seed=3, after_restart=2, restart_window_s=1.5)
    a, b = plan_notices(o), plan_notices(o)
    assert a == b and len(a) == 6
    assert sum(p.restart for p in a) == 2 and all(p.after <= 1.5 for p in a if p.restart)
    # The first machine's start is no restart: a draw that picks it moves to another machine.
    for seed in range(40):
        first = plan_notices(RehearsalOptions(["true"], preemptions=3, mtbf_s=2.0, seed=seed, after_restart=2))[0]
        assert not first.restart
    assert plan_notices(RehearsalOptions(["true"], preemptions=6, mtbf_s=2.0, seed=4)) != a


def test_notices_for_a_save_or_an_evaluation_are_others_than_those_after_a_restart():
    kw = {"preemptions": 6, "mtbf_s": 2.0, "seed": 3, "after_restart": 2}
    plain = plan_notices(RehearsalOptions(["true"], **kw))
    timed = plan_notices(RehearsalOptions(["true"], **kw, during_save=2, during_eval=1))
    assert [p.during for p in plain] == [None] * 6
    assert sorted(str(p.during) for p in timed) == ["None", "None", "None", "evaluation", "save", "save"]
    assert not any(p.restart and p.during for p in timed)
    # The same moments: only where some of them wait is added (a seed keeps its older plans).
    assert [(p.after, p.restart) for p in timed] == [(p.after, p.restart) for p in plain]


def test_where_a_notice_lands_is_read_from_the_heartbeats_marks():
    slots = memoryview(bytearray(heartbeat.SIZE)).cast("q")
    assert landed(slots, stepped=False) == "startup" and landed(slots, stepped=True) == "step"
    slots[heartbeat.SAVING] = 21
    assert landed(slots, stepped=True) == "save"
    slots[heartbeat.EVALUATING] = 21
    assert landed(slots, stepped=True) == "save+evaluation"
    slots[heartbeat.SAVING] = 0
    assert landed(slots, stepped=False) == "evaluation"


def test_an_approved_notice_ends_the_paid_window_at_its_approval():
    ms = machines()
    ms[0].approved = 21.0  # Azure: approved 0.5 s after the commit at t=20.5
    (p,) = measure(ms, lead_s=30.0, mtbf_asked_s=None, has_storage=True).preemptions
    assert p.idle_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"command": []}, "no command"),
        ({"source": "ibm"}, "unknown notice source"),
        ({"mtbf_s": 0}, "mtbf_s"),
        ({"preemptions": 2, "after_restart": 3}, "after_restart"),
        ({"preemptions": 2, "after_restart": 2}, "no restart"),
        ({"preemptions": 2, "during_save": -1}, "during_save"),
        ({"preemptions": 3, "after_restart": 1, "during_save": 1, "during_eval": 2}, "more than the 3"),
        ({"lead_s": float("nan")}, "lead_s"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RehearsalOptions(**{"command": ["true"], **kwargs})
