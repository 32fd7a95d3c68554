"""The goodput model, the recommendation and the stats file."""

from __future__ import annotations

import json
import math

import pytest

from spotguard.errors import ConfigError
from spotguard.guard.stats import DEFAULT_START_S, load_stats
from spotguard.planner import (
    PlanOptions,
    best_interval,
    daly_interval,
    goodput,
    lost_work,
    plan,
    window_reserve,
    window_work,
    young_interval,
)

H = 3600.0


def test_young_is_sqrt_two_c_mtbf_and_daly_refines_it_toward_the_exact_optimum():
    for c, m in [(10.0, 6 * H), (60.0, 6 * H), (600.0, 2 * H), (1800.0, 1 * H)]:
        assert young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m))
        exact = best_interval(lambda t, c=c, m=m: goodput(t, c, 0.0, m), 1.0, 100 * m)
        assert abs(daly_interval(c, m) - exact) <= abs(young_interval(c, m) - exact) + 1e-6
        # Daly's estimate costs (almost) nothing against the true optimum of the model
        assert goodput(daly_interval(c, m), c, 0.0, m) == pytest.approx(goodput(exact, c, 0.0, m), rel=2e-3)


def test_daly_falls_back_to_mtbf_when_checkpoints_cost_more_than_two_mtbf():
    assert daly_interval(3 * H, 1 * H) == 1 * H


def test_restart_cost_lowers_goodput_by_exp_minus_r_over_m_but_does_not_move_the_optimum():
    c, m = 60.0, 6 * H
    best_free = best_interval(lambda t: goodput(t, c, 0.0, m), 1.0, 50 * m)
    best_costly = best_interval(lambda t: goodput(t, c, 900.0, m), 1.0, 50 * m)
    assert best_costly == pytest.approx(best_free, rel=1e-4)
    assert goodput(best_free, c, 900.0, m) == pytest.approx(goodput(best_free, c, 0.0, m) * math.exp(-900.0 / m))


def test_goodput_tends_to_the_checkpoint_overhead_when_failures_are_rare():
    c, tau = 30.0, 600.0
    assert goodput(tau, c, 100.0, 1e9 * H) == pytest.approx(tau / (tau + c), rel=1e-6)


def test_notice_long_enough_to_save_reduces_lost_work_by_its_share():
    c, m, tau = 60.0, 6 * H, 1800.0
    plain = lost_work(tau, c, m)
    assert 0.4 * tau < plain < 0.6 * tau
    assert lost_work(tau, c, m, notice_share=0.75, notice_s=120.0) == pytest.approx(0.25 * plain)
    assert goodput(tau, c, 180.0, m, notice_share=0.75, notice_s=120.0) > goodput(tau, c, 180.0, m)


def test_a_notice_shorter_than_the_checkpoint_cost_counts_as_no_notice():
    c, m, tau = 60.0, 6 * H, 1800.0
    assert goodput(tau, c, 180.0, m, notice_share=0.9, notice_s=30.0) == goodput(tau, c, 180.0, m)
    opts = PlanOptions(60, 180, 6, notice_s=30)
    assert not opts.notice_works
    p = plan(opts)
    assert p.interval_s == pytest.approx(daly_interval(60, 6 * H))


def test_plan_without_notice_recommends_daly_and_beats_every_fixed_interval():
    p = plan(PlanOptions(checkpoint_s=60, restart_s=180, mtbf_hours=6))
    assert p.interval_s == pytest.approx(daly_interval(60, 6 * H))
    assert p.young_s == pytest.approx(math.sqrt(2 * 60 * 6 * H))
    assert p.goodput == pytest.approx(goodput(p.interval_s, 60, 180, 6 * H))
    assert p.rows[-1].name.startswith("recommended") and not p.rows[-1].emergency
    fixed = [r for r in p.rows if r.name.startswith("every")]
    assert len(fixed) == 5 and all(r.goodput < p.goodput for r in fixed)
    none = p.rows[0]
    assert none.interval_s is None and none.goodput < min(r.goodput for r in fixed)


def test_plan_with_notice_covers_only_the_share_without_notice():
    p = plan(PlanOptions(60, 180, 6, notice_s=120, notice_share=0.75))
    assert p.effective_mtbf_s == pytest.approx(4 * 6 * H)
    assert p.interval_s == pytest.approx(daly_interval(60, 24 * H))
    assert p.interval_s > 1.9 * daly_interval(60, 6 * H)  # sqrt(4) longer, to first order
    plain = next(r for r in p.rows if r.name.startswith("recommended"))
    assert p.rows[-1].emergency and p.goodput == p.rows[-1].goodput > plain.goodput
    assert p.lost_work_s < plain.lost_work_s


def test_plan_defaults_share_and_lead_when_only_one_is_given_and_caps_at_the_job_length():
    assert PlanOptions(60, 180, 6, notice_s=120).notice_share == 0.9
    assert PlanOptions(60, 180, 6, notice_share=0.5).notice_s == 30.0
    p = plan(PlanOptions(60, 180, 6, notice_s=120, notice_share=1.0, job_hours=10))
    assert math.isinf(p.effective_mtbf_s) and p.interval_s == 10 * H
    json.dumps(p.to_dict(), allow_nan=False)  # no Infinity in the JSON


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"checkpoint_s": -1}, "checkpoint cost"),
        ({"checkpoint_s": 0}, "checkpoint cost"),
        ({"restart_s": float("nan")}, "restart cost"),
        ({"mtbf_hours": 0}, "MTBF"),
        ({"mtbf_hours": "six"}, "MTBF"),
        ({"notice_share": 1.5}, "notice share"),
        ({"notice_s": -5}, "notice lead"),
        ({"job_hours": float("inf")}, "job length"),
        ({"intervals_s": (600, 0)}, "interval"),
    ],
)
def test_bad_plan_options_raise_a_clear_config_error(kwargs, word):
    base = {"checkpoint_s": 60, "restart_s": 180, "mtbf_hours": 6}
    with pytest.raises(ConfigError, match=word):
        PlanOptions(**{**base, **kwargs})


def test_stats_file_gives_the_blocking_cost_averaged_over_json_lines(tmp_path):
    f = tmp_path / "stats.jsonl"
    f.write_text(
        '{"snapshot_s": 1.0, "write_s": 9.0, "restart_s": 50, "state_bytes": 2e9}\n'
        '{"snapshot_s": [2.0, 4.0], "write_s": 11.0}\n'
    )
    got = load_stats(f)
    assert got.checkpoint_s == pytest.approx((10.0 + 14.0) / 2)
    assert got.restart_s == 50 and got.state_gb == pytest.approx(2.0)
    f.write_text(json.dumps({"snapshot_s": 1.5, "write_s": 30.0, "async": True}))
    assert load_stats(f).checkpoint_s == 1.5 and load_stats(f).restart_s is None
    f.write_text(json.dumps({"snapshot_s": None, "write_s": 8.0, "restart_s": None, "restore_s": 5.0, "async": False}))
    got = load_stats(f)  # null is "not measured"; without restart_s, the restore plus the default start
    assert got.checkpoint_s == 8.0 and got.restart_s == 5.0 + DEFAULT_START_S


@pytest.mark.parametrize(
    "text, word",
    [
        ("not json", "not JSON"),
        ('{"snapshot_s": "fast"}', "snapshot_s"),
        ('{"write_s": -3}', "write_s"),
        ('{"other": 1}', "no snapshot_s"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_bad_stats_file_raises_a_clear_config_error(tmp_path, text, word):
    f = tmp_path / "stats.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=word):
        load_stats(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_stats(tmp_path / "missing.json")


def test_use_window_keeps_the_notice_lead_as_training_and_leaves_the_saves_and_margin_idle():
    assert window_reserve(2.0, 5.0) == pytest.approx(7.5)
    assert window_work(120.0, 2.0, 5.0) == pytest.approx(120 - 2 - 7.5)  # the first save, then the reserve
    assert window_work(30.0, 10.0, 5.0) == pytest.approx(2.5)
    assert window_work(10.0, 10.0, 5.0) == 0.0 and window_work(None, 1.0) == 0.0  # no window opens
    stop = PlanOptions(0.5, 4.0, 2.0, notice_s=120.0, save_s=1.0)
    use = PlanOptions(0.5, 4.0, 2.0, notice_s=120.0, save_s=1.0, deadline_policy="use-window")
    assert stop.idle_s() == 120.0 and stop.window_s() == 0.0
    assert use.idle_s() == pytest.approx(1.0 + 1.25 + 5.0) and use.idle_s() <= 10.0  # the AWS target
    p_stop, p_use = plan(stop), plan(use)
    assert p_use.interval_s == p_stop.interval_s  # the interval covers the preemptions without notice alike
    assert p_use.goodput > p_stop.goodput
    assert p_use.window_s == pytest.approx(use.window_s()) and p_use.idle_s == pytest.approx(use.idle_s())
    # the last row is the chosen policy, the one before it the other, for comparison
    assert [(r.name, r.deadline_policy) for r in p_stop.rows[-2:]] == [
        ("notice + rec. (use-window)", "use-window"),
        ("notice + recommended", "stop"),
    ]
    assert p_stop.rows[-2].goodput == pytest.approx(p_use.goodput)


def test_use_window_goodput_adds_the_window_work_of_each_noticed_preemption():
    c, r, m, tau = 1.0, 4.0, 0.1 * H, 60.0
    lam = 1 / m
    base = goodput(tau, c, r, m, notice_share=0.9, notice_s=120.0)
    used = goodput(tau, c, r, m, notice_share=0.9, notice_s=120.0, window_s=100.0)
    fail = -math.expm1(-lam * (tau + c))
    wall = fail / lam + fail * (math.expm1(lam * r) / lam + 0.9 * 120.0)
    assert used - base == pytest.approx(0.9 * fail * 100.0 / wall)
    assert goodput(tau, c, r, m, notice_share=0.9, notice_s=120.0, window_s=500.0) == pytest.approx(
        goodput(tau, c, r, m, notice_share=0.9, notice_s=120.0, window_s=120.0)
    )  # never more than the lead


def test_the_interval_is_never_below_the_time_a_save_takes_to_commit():
    """An async snapshot of milliseconds at a short MTBF gave Daly intervals below one second, while each
    save takes a second to commit: every other one would only be skipped."""
    o = PlanOptions(0.002, 4.0, 0.002, notice_s=120.0, save_s=0.8)
    assert daly_interval(0.002, o.mtbf_s / 0.1) < 0.8
    p = plan(o)
    assert p.interval_s == pytest.approx(0.8) and p.optimum_s >= 0.8 * 0.999
    assert all(r.interval_s >= 0.8 for r in p.rows if r.interval_s is not None)
    assert PlanOptions(60, 180, 6).save_s == 60  # without a save time: the checkpoint cost
    with pytest.raises(ConfigError, match="deadline policy"):
        PlanOptions(60, 180, 6, deadline_policy="window")
    with pytest.raises(ConfigError, match="save time"):
        PlanOptions(60, 180, 6, save_s=-1)


def test_a_restart_cost_of_hundreds_of_mtbfs_gives_goodput_zero_not_an_overflow():
    c, r, m = 10.0, 3000.0, 0.001 * H  # e^(R/M) = e^833: past a float; the restart never completes
    assert goodput(60.0, c, r, m) == 0.0  # was: OverflowError
    assert goodput(60.0, c, r, m, notice_share=0.9, notice_s=120.0) == 0.0
    assert goodput(60.0, c, 2.0, m) > 0.0  # a cheap restart still trains
    p = plan(PlanOptions(c, r, 0.001, notice_s=120.0))
    assert p.goodput == 0.0 and all(row.goodput == 0.0 for row in p.rows)
    assert json.dumps(p.to_dict(), allow_nan=False)  # the CLI's --json prints it
