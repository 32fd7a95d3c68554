"""``spotguard plan``: the table, exactly one JSON document, the stats file and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spotguard.costs import DEFAULT_START_S
from spotguard.ops.cli import main
from spotguard.planner import daly_interval, goodput
from tests.helpers import subprocess_env

BASE = ["plan", "--checkpoint-cost", "60", "--restart-cost", "180", "--mtbf", "6"]


def run_json(capsys, *args: str) -> dict:
    assert main([*BASE, "--json", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_json_is_exactly_one_document_on_stdout_with_the_recommendation():
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", *BASE, "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # fails on any extra output
    assert doc["interval_s"] == pytest.approx(daly_interval(60, 6 * 3600))
    assert doc["goodput"] == pytest.approx(goodput(doc["interval_s"], 60, 180, 6 * 3600))
    assert {r["name"] for r in doc["rows"]} >= {"no checkpoints", "every 1 h", "recommended (Young/Daly)"}


def test_notice_lengthens_the_interval_and_raises_goodput(capsys):
    plain = run_json(capsys)
    noticed = run_json(capsys, "--notice", "120", "--notice-share", "0.75")
    assert noticed["interval_s"] == pytest.approx(daly_interval(60, 4 * 6 * 3600))
    assert noticed["goodput"] > plain["goodput"]
    assert noticed["rows"][-1]["name"] == "notice + recommended"
    gcp = run_json(capsys, "--cloud", "gcp", "--notice-share", "0.75")
    assert gcp["options"]["notice_s"] == 30.0


def test_table_lists_every_strategy_and_the_recommendation(capsys):
    assert main([*BASE, "--notice", "120", "--state-gb", "10", "--intervals", "600,3600"]) == 0
    out = capsys.readouterr().out
    for word in (
        "no checkpoints",
        "every 10 min",
        "every 1 h",
        "recommended (Young/Daly)",
        "notice + recommended",
        "GB/H",
        "recommendation: checkpoint every",
    ):
        assert word in out


def test_costs_come_from_a_stats_file_and_flags_override_it(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"snapshot_s": 5.0, "write_s": 25.0, "restart_s": 90.0, "state_bytes": 3e9}))
    assert main(["plan", "--mtbf", "6", "--stats", str(stats), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["options"]["checkpoint_s"] == 30.0 and doc["options"]["restart_s"] == 90.0
    assert doc["options"]["state_gb"] == pytest.approx(3.0)
    assert doc["interval_s"] == pytest.approx(daly_interval(30, 6 * 3600))
    assert main(["plan", "--mtbf", "6", "--stats", str(stats), "--checkpoint-cost", "120", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["options"]["checkpoint_s"] == 120.0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_record_of_a_real_guard_feeds_plan_stats(tmp_path, async_save):
    """The README's record, json.dumps(guard.stats().as_dict()), after a resume and a periodic save:
    the checkpoint cost is what blocked the loop (the snapshot, or the whole synchronous write) and
    the restart cost the measured restore plus the default start."""
    import torch

    import spotguard

    ckpt, model = str(tmp_path / "ckpt"), torch.nn.Linear(64, 64)
    spotguard.Guard(ckpt, providers=[], async_save=async_save).track(model=model).save(1)
    guard = spotguard.Guard(ckpt, providers=[], every_steps=1, async_save=async_save, save_on_exit=False)
    assert guard.track(model=model).resume() == 1
    with guard:
        guard.step(2)
    record = guard.stats().as_dict()
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(record))
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", "plan", "--stats", str(stats), "--mtbf", "6", "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    options = json.loads(proc.stdout)["options"]
    assert record["async"] is async_save and record["checkpoints"] == 1
    blocking = record["snapshot_s"] if async_save else record["write_s"]
    assert blocking and options["checkpoint_s"] == pytest.approx(blocking)
    assert record["restore_s"] and options["restart_s"] == pytest.approx(record["restore_s"] + DEFAULT_START_S)


@pytest.mark.parametrize(
    "args, word",
    [
        (["plan", "--mtbf", "6", "--restart-cost", "60"], "--checkpoint-cost"),
        ([*BASE[:5], "--mtbf", "-2"], "MTBF"),
        ([*BASE, "--notice-share", "3"], "notice share"),
        ([*BASE, "--intervals", "600,soon"], "--intervals"),
        ([*BASE, "--stats", "/nonexistent/stats.json"], "cannot read stats"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message_and_no_stdout(capsys, args, word):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert word in captured.err and captured.out == ""


def test_plot_draws_a_png(tmp_path, capsys):
    out = tmp_path / "plan.png"
    doc = run_json(capsys, "--notice", "120", "--plot", str(out))
    assert doc["plot"] == str(out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_without_matplotlib_says_which_extra_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main([*BASE, "--plot", str(tmp_path / "p.png")]) == 2
    assert "spotguard[plot]" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_a_notice_too_short_to_save_is_reported_and_ignored(capsys):
    assert main([*BASE, "--notice", "20"]) == 0
    out = capsys.readouterr().out
    assert "too short to write a checkpoint" in out and "covering every preemption" in out
    assert "plus an emergency checkpoint" not in out


def test_aws_with_use_window_charges_the_saves_not_the_whole_notice_and_never_saves_faster_than_a_commit(
    tmp_path, capsys
):
    """An async guard's record: a 2 ms snapshot, a 0.8 s write. At a 7 s MTBF Daly's interval was 0.54 s,
    shorter than a save takes to commit; and --cloud aws charged the 120 s lead to every noticed preemption."""
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"snapshot_s": 0.002, "write_s": 0.8, "async": True, "restart_s": 4.0}))
    args = ["plan", "--mtbf", "0.002", "--cloud", "aws", "--stats", str(stats)]
    assert main([*args, "--json"]) == 0
    stop = json.loads(capsys.readouterr().out)
    assert stop["interval_s"] >= 0.8 and stop["options"]["save_s"] == 0.8
    assert stop["idle_s"] == 120.0 and stop["window_s"] == 0.0
    assert main([*args, "--deadline-policy", "use-window", "--json"]) == 0
    use = json.loads(capsys.readouterr().out)
    assert use["idle_s"] == pytest.approx(
        0.8 + 0.8 * 1.25 + 5.0
    )  # the first save, then the reserve and use["goodput"] > stop["goodput"]
    assert main([*args, "--deadline-policy", "use-window", "--window-margin", "2"]) == 0
    out = capsys.readouterr().out
    assert "deadline policy use-window: per noticed preemption 116 s of the notice trained and kept, 4 s paid" in out
    assert "training on in the notice window" in out and "notice + rec. (stop)" in out


def test_a_first_runs_metrics_file_plans_with_the_restart_cost_it_could_not_measure_named(tmp_path):
    """docs/metrics.md: the metrics file is a stats file as it is. A first run resumed nothing, so its
    records have ``restore_s: null``: the plan uses what was measured and says which figure it assumed
    (it was: "give --checkpoint-cost and --restart-cost", exit 2)."""
    import torch

    import spotguard

    metrics = tmp_path / "metrics.jsonl"
    guard = spotguard.Guard(str(tmp_path / "ckpt"), providers=[], every_steps=1, metrics_file=str(metrics))
    guard.track(model=torch.nn.Linear(8, 8))
    assert guard.resume() == 0
    with guard:
        guard.step(1)
    cmd = [sys.executable, "-m", "spotguard", "plan", "--stats", str(metrics), "--mtbf", "6"]
    text = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert f"assumed: restart cost {DEFAULT_START_S:g} s: {metrics} measured no restore" in text.stdout
    doc = subprocess.run([*cmd, "--json"], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    plan = json.loads(doc.stdout)
    assert plan["options"]["restart_s"] == DEFAULT_START_S and plan["options"]["checkpoint_s"] > 0
    assert plan["assumed"] and "restart cost" in plan["assumed"][0]
    given = subprocess.run(
        [*cmd, "--restart-cost", "90", "--json"], env=subprocess_env(), capture_output=True, text=True
    )
    assert json.loads(given.stdout)["assumed"] == []  # a figure given is no assumption


def test_a_restart_cost_far_above_the_mtbf_plans_goodput_zero_without_a_traceback(capsys):
    assert main(["plan", "--checkpoint-cost", "10", "--restart-cost", "3000", "--mtbf", "0.001"]) == 0
    out = capsys.readouterr().out  # was: OverflowError from math.expm1
    assert "goodput 0.0%" in out.splitlines()[-2]
    assert out.splitlines()[-1].startswith("no interval makes progress: a restart of 3000 s against an MTBF of 3.6 s")
