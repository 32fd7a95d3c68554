"""The adaptive interval of ``every_seconds="auto"``: the planner's value from noisy measured costs."""

from __future__ import annotations

import itertools
import logging
import random

import pytest

from spotguard.errors import ConfigError
from spotguard.guard.adaptive import AdaptiveInterval
from spotguard.planner import PlanOptions, daly_interval, plan

H = 3600.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_adaptive_interval_converges_to_the_planner_value_from_noisy_measurements(caplog):
    clock, rng = FakeClock(), random.Random(7)
    adaptive = AdaptiveInterval(mtbf_hours=6, initial_s=600, window=16, clock=clock)
    caplog.set_level(logging.INFO, logger="spotguard.guard.adaptive")
    used = [adaptive.interval]
    for _ in range(200):
        clock.now += adaptive.interval  # training until the checkpoint is due
        with adaptive.measure():
            clock.now += rng.uniform(40.0, 80.0)  # a checkpoint that costs 60 s on average
        if adaptive.interval != used[-1]:
            used.append(adaptive.interval)
    target = plan(PlanOptions(60, 180, 6)).interval_s
    # The interval in use moves only when the estimate leaves the hysteresis band around it.
    assert adaptive.interval == pytest.approx(target, rel=adaptive.tolerance)
    logged = [r.args[:2] for r in caplog.records if "checkpoint interval" in r.getMessage()]
    assert logged == list(itertools.pairwise(used))  # every change of the interval in use, and only those
    assert 1 <= len(logged) <= 5  # not on every noisy measurement
    assert logged[0][0] == 600


def test_adaptive_interval_follows_a_change_in_checkpoint_cost():
    adaptive = AdaptiveInterval(mtbf_hours=2, window=4, clock=FakeClock())
    for _ in range(4):
        adaptive.observe(10.0)
    assert adaptive.interval == pytest.approx(daly_interval(10.0, 2 * H))
    for _ in range(4):
        adaptive.observe(90.0)
    assert adaptive.mean_cost == 90.0
    assert adaptive.interval == pytest.approx(plan(PlanOptions(90, 0, 2)).interval_s)


def test_adaptive_interval_respects_its_bounds_and_rejects_bad_input():
    adaptive = AdaptiveInterval(mtbf_hours=100, min_s=30, max_s=900)
    assert adaptive.observe(0.0) == 30
    assert adaptive.observe(500.0) == 900
    with pytest.raises(ConfigError, match="checkpoint_seconds"):
        adaptive.observe(-1.0)
    with pytest.raises(ConfigError, match="mtbf_hours"):
        AdaptiveInterval(mtbf_hours=0)
    with pytest.raises(ConfigError, match="window"):
        AdaptiveInterval(mtbf_hours=1, window=0)


def test_adaptive_interval_with_notices_matches_the_plan_until_checkpoints_outgrow_the_notice():
    adaptive = AdaptiveInterval(mtbf_hours=6, notice_s=120, notice_share=0.75, window=2)
    adaptive.observe(60.0)
    assert adaptive.interval == pytest.approx(plan(PlanOptions(60, 180, 6, notice_s=120, notice_share=0.75)).interval_s)
    adaptive.observe(200.0)
    adaptive.observe(200.0)  # 200 s checkpoints no longer fit in a 120 s notice: cover every preemption
    assert adaptive.interval == pytest.approx(daly_interval(200.0, 6 * H))
