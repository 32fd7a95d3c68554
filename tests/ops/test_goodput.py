"""The Monte Carlo simulator agrees with the analytic model, and walks a trace as described."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from spotguard.errors import ConfigError
from spotguard.ops.goodput import SimOptions, load_trace, simulate
from spotguard.planner import PlanOptions, goodput, lost_work, plan

H = 3600.0


@pytest.mark.parametrize(
    "cost, restart, mtbf, share, cloud",
    [
        (60.0, 180.0, 6.0, 0.0, None),  # plain Young/Daly
        (60.0, 180.0, 6.0, 0.9, "aws"),  # 120 s notice: emergency saves work
        (20.0, 60.0, 1.0, 0.5, "gcp"),  # 30 s notice, still long enough for a 20 s checkpoint
        (300.0, 600.0, 2.0, 0.8, "azure"),  # 30 s notice, too short for a 300 s checkpoint
    ],
)
def test_simulated_goodput_agrees_with_the_analytic_model_at_the_recommendation(cost, restart, mtbf, share, cloud):
    p = plan(
        PlanOptions(
            cost,
            restart,
            mtbf,
            notice_share=share or None,
            notice_s={"aws": 120.0, "gcp": 30.0, "azure": 30.0}.get(cloud or ""),
        )
    )
    sim = simulate(
        SimOptions(
            cost,
            restart,
            p.interval_s,
            job_hours=4000 * mtbf,
            mtbf_hours=mtbf,
            notice_share=share,
            cloud=cloud,
            seed=11,
        )
    )
    assert sim.preemptions > 3000
    assert sim.goodput == pytest.approx(p.goodput, abs=0.005)
    assert sim.lost_work_s == pytest.approx(p.lost_work_s, rel=0.05)
    if cloud == "azure":
        assert sim.saved_by_notice == 0  # 30 s is too short to write 300 s of checkpoint
    elif share:
        assert sim.saved_by_notice / sim.preemptions == pytest.approx(share, abs=0.03)


def test_simulated_job_without_checkpoints_matches_the_analytic_figure():
    sim = simulate(SimOptions(60.0, 180.0, None, job_hours=12, mtbf_hours=6, runs=3000, seed=3))
    expected = goodput(12 * H, 0.0, 180.0, 6 * H)
    assert sim.checkpoints == 0
    assert sim.goodput == pytest.approx(expected, rel=0.05)
    assert sim.lost_work_s == pytest.approx(lost_work(12 * H, 0.0, 6 * H), rel=0.05)


def test_simulated_recommendation_beats_other_intervals():
    def run(interval: float) -> float:
        return simulate(SimOptions(60.0, 180.0, interval, job_hours=3000 * 6, mtbf_hours=6, seed=5)).goodput

    best = plan(PlanOptions(60, 180, 6)).interval_s
    assert run(best) > run(best / 4) and run(best) > run(best * 4)


def test_trace_is_walked_segment_by_segment(tmp_path):
    # segments of 300 s compute + 10 s checkpoint: 0-310, 310-620, 620-930, then preempted at 1000
    f = tmp_path / "trace.txt"
    f.write_text("# preemption times in seconds\n1000\n")
    trace = load_trace(f)
    assert trace == [1000.0]
    sim = simulate(SimOptions(10.0, 50.0, 300.0, job_hours=1.0, trace=trace))
    # 70 s of compute lost; restart until 1050; 2700 s left = 8 segments with checkpoints + 1 without
    assert sim.preemptions == 1 and sim.lost_work_s == 70.0
    assert sim.wall_s == pytest.approx(1050.0 + 8 * 310.0 + 300.0)
    assert sim.goodput == pytest.approx(3600.0 / sim.wall_s)


def test_notice_on_a_trace_saves_the_work_but_costs_the_lead(tmp_path):
    f = tmp_path / "trace.json"
    f.write_text(json.dumps([1000.0]))
    sim = simulate(SimOptions(10.0, 50.0, 300.0, job_hours=1.0, trace=load_trace(f), notice_share=1.0, cloud="aws"))
    # the notice at 880 s stops the segment begun at 620 s: 600 + 260 s are kept, 2740 s are left
    assert sim.saved_by_notice == 1 and sim.lost_work_s == 0.0
    assert sim.wall_s == pytest.approx(1050.0 + 9 * 310.0 + 40.0)
    # without emergency checkpoints the same notice is worth nothing
    plain = simulate(
        SimOptions(10.0, 50.0, 300.0, job_hours=1.0, trace=[1000.0], notice_share=1.0, cloud="aws", emergency=False)
    )
    assert plain.saved_by_notice == 0 and plain.lost_work_s == 70.0


def test_preemption_during_restart_starts_the_restart_over():
    sim = simulate(SimOptions(10.0, 50.0, 300.0, job_hours=1.0, trace=[1000.0, 1030.0]))
    assert sim.preemptions == 1
    assert sim.wall_s == pytest.approx(1080.0 + 8 * 310.0 + 300.0)


def test_simulator_uses_a_private_generator_and_is_reproducible():
    random.seed(1)
    np.random.seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy())
    opts = dict(
        checkpoint_s=60.0,
        restart_s=180.0,
        interval_s=1500.0,
        job_hours=600,
        mtbf_hours=6,
        notice_share=0.5,
        cloud="aws",
        seed=42,
    )
    a, b = simulate(SimOptions(**opts)), simulate(SimOptions(**opts))
    assert a == b
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert simulate(SimOptions(**{**opts, "seed": 43})) != a


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({}, "exactly one preemption process"),
        ({"mtbf_hours": 6, "trace": [1.0]}, "exactly one preemption process"),
        ({"mtbf_hours": 6, "cloud": "oracle"}, "unknown cloud"),
        ({"mtbf_hours": 6, "notice_share": 2}, "notice_share"),
        ({"mtbf_hours": 6, "runs": 0}, "runs"),
        ({"trace": [5.0, -1.0]}, "preemption time"),
    ],
)
def test_bad_sim_options_raise_a_clear_config_error(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        SimOptions(60.0, 180.0, 600.0, **kwargs)


def test_bad_trace_file_raises_a_clear_config_error(tmp_path):
    f = tmp_path / "trace.txt"
    f.write_text("100\nsoon\n")
    with pytest.raises(ConfigError, match="not a preemption trace"):
        load_trace(f)
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(tmp_path / "nope.txt")


@pytest.mark.parametrize("cloud, save", [("aws", 2.0), ("gcp", 5.0)])
def test_simulated_use_window_agrees_with_the_analytic_model(cloud, save):
    o = PlanOptions(0.5, 30.0, 0.5, notice_share=0.9, save_s=save, deadline_policy="use-window")
    o.notice_s = {"aws": 120.0, "gcp": 30.0}[cloud]
    p = plan(o)
    assert p.window_s > 0
    sim = simulate(
        SimOptions(0.5, 30.0, p.interval_s, job_hours=3000 * 0.5, mtbf_hours=0.5, notice_share=0.9, cloud=cloud, seed=5)
    )
    used = simulate(
        SimOptions(
            0.5,
            30.0,
            p.interval_s,
            job_hours=3000 * 0.5,
            mtbf_hours=0.5,
            notice_share=0.9,
            cloud=cloud,
            seed=5,
            window_s=p.window_s,
        )
    )
    assert used.goodput == pytest.approx(p.goodput, abs=0.005)
    # the lead trained, not idle: about share * window / MTBF more goodput
    assert used.goodput - sim.goodput > 0.5 * 0.9 * p.window_s / (0.5 * H)
