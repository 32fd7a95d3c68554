"""A Guard's metrics: a real endpoint on 127.0.0.1 scraped over HTTP during training, and the JSON lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import spotguard
from spotguard import planner
from spotguard.costs import DEFAULT_START_S, load_stats
from spotguard.notices.aws import AwsProvider

from ..helpers import subprocess_env


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET the endpoint and parse it with prometheus_client's own parser: {(sample name, labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_endpoint_reports_steps_checkpoints_notices_by_kind_and_the_stop(tmp_path, mock_metadata):
    server = mock_metadata("aws")
    jsonl = tmp_path / "metrics.jsonl"
    guard = spotguard.Guard(
        str(tmp_path / "ckpt"),
        every_steps=5,
        providers=[AwsProvider(server.url)],
        interval=0.05,
        metrics_port=0,
        metrics_file=str(jsonl),
        mtbf_hours=6,
    )
    guard.track(model=torch.nn.Linear(8, 8))
    assert guard.resume() == 0
    url = guard.metrics.endpoint.url
    assert url.startswith("http://127.0.0.1:")  # never on every interface unless asked
    with guard:
        for step in range(1, 13):
            guard.step(step)
            if step % 5 == 0:
                guard.wait()  # the background save commits: the figures below are settled
        # The metrics hear of a commit through a queue (the guard's thread never waits): let it drain.
        wait_for(lambda: value(scrape(url), "spotguard_last_checkpoint_step") == 10)
        got, st = scrape(url), guard.stats()
        assert value(got, "spotguard_step") == 12
        assert value(got, "spotguard_step_timestamp_seconds") == pytest.approx(time.time(), abs=30)
        assert value(got, "spotguard_checkpoints_total") == st.checkpoints == 2
        assert value(got, "spotguard_last_checkpoint_step") == 10
        assert value(got, "spotguard_checkpoint_stall_seconds") == pytest.approx(st.last_stall_s)
        assert value(got, "spotguard_checkpoint_write_bytes_per_second") == pytest.approx(st.write_Bps)
        assert value(got, "spotguard_checkpoint_size_bytes") == st.state_bytes
        assert value(got, "spotguard_saves_skipped_total") == st.skipped
        assert value(got, "spotguard_saves_failed_total") == 0
        assert value(got, "spotguard_preemption_lost_seconds_count") == 0
        # The planner's estimate from the measured costs (snapshot stall; restore unmeasured + start),
        # with the AWS notice lead for the share of preemptions that come with one.
        plan = planner.plan(planner.PlanOptions(st.snapshot_s, DEFAULT_START_S, 6, notice_s=120, intervals_s=()))
        assert value(got, "spotguard_goodput_recommended") == pytest.approx(plan.goodput)
        assert value(got, "spotguard_checkpoint_interval_recommended_seconds") == pytest.approx(plan.interval_s)

        server.mock.trigger("rebalance")  # advisory: an early checkpoint, training goes on
        wait_for(lambda: st.notices.get("rebalance") == 1)
        assert not guard.step(13)
        guard.wait()
        got = scrape(url)
        assert value(got, "spotguard_notices_total", kind="rebalance") == 1
        assert value(got, "spotguard_notices_total", kind="terminate") is None
        assert value(got, "spotguard_checkpoints_total") == 3 and value(got, "spotguard_step") == 13

        server.mock.trigger("spot")  # the two-minute warning: stop with an emergency checkpoint
        guard.preempted.wait(20)
        assert guard.step(14)
        got = scrape(url)
        assert value(got, "spotguard_notices_total", kind="terminate") == 1
        assert value(got, "spotguard_checkpoints_total") == 4
        wait_for(lambda: value(scrape(url), "spotguard_preemption_lost_seconds_count") == 1)
        assert value(scrape(url), "spotguard_preemption_lost_seconds_sum") == 0  # the emergency one committed
    with pytest.raises(urllib.error.URLError):  # the endpoint goes with the guard
        urllib.request.urlopen(url, timeout=5)

    recs = records(jsonl)
    events = [r["event"] for r in recs]
    assert events[0] == "resume" and events[-2:] == ["stop", "close"]
    assert [(r["step"], r["reason"]) for r in recs if r["event"] == "checkpoint"] == [
        (5, "periodic"),
        (10, "periodic"),
        (13, "advisory"),
        (14, "emergency"),
    ]
    assert [r["kind"] for r in recs if r["event"] == "notice"] == ["rebalance", "terminate"]
    stop = recs[-2]
    assert stop["committed"] and stop["lost_s"] == 0 and stop["step"] == 14 and stop["provider"] == "aws"
    assert recs[-1]["checkpoints"] == 4 and recs[-1]["notices"] == {"rebalance": 1, "terminate": 1}
    # The file is a stats file for `spotguard plan --stats` as it is.
    assert load_stats(jsonl).checkpoint_s == pytest.approx(
        sum(r["snapshot_s"] for r in recs if r.get("snapshot_s") is not None)
        / sum(1 for r in recs if r.get("snapshot_s") is not None)
    )


def test_failed_saves_and_the_work_lost_when_the_emergency_checkpoint_fails(tmp_path):
    """A plain file where a step's directory must go makes its save fail for real."""
    root, jsonl = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    guard = spotguard.Guard(
        str(root), every_steps=5, providers=["signal"], interval=0.05, async_save=False, metrics_file=str(jsonl)
    )
    guard.track(model=torch.nn.Linear(4, 4))
    guard.resume()
    with pytest.raises(OSError, match="it is a file, not a folder"), guard:  # a clean exit re-raises the failed save
        for step in range(1, 6):
            guard.step(step)
        committed_at = time.time()
        root.joinpath("step-00000010").write_text("in the way")
        root.joinpath("step-00000012").write_text("in the way")
        for step in range(6, 12):
            assert not guard.step(step)  # step 10's save fails; training goes on
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.preempted.wait(10)
        assert guard.step(12)
        stopped_at = time.time()
    recs = records(jsonl)
    assert [(r["step"], r["reason"]) for r in recs if r["event"] == "failed"] == [(10, "periodic"), (12, "emergency")]
    (stop,) = [r for r in recs if r["event"] == "stop"]
    assert not stop["committed"] and stop["resume_step"] == 5 and stop["lost_steps"] == 7
    # From step 5's commit (its manifest's time) to the stop.
    assert 0.5 <= stop["lost_s"] <= stopped_at - committed_at + 1.0
    assert recs[-1]["event"] == "close" and recs[-1]["failures"] == 2 and recs[-1]["notices"] == {"signal": 1}


def test_resume_point_of_an_earlier_run_counts_for_the_work_lost(tmp_path):
    """After a resume, the resumed checkpoint's commit time is where lost work starts."""
    root = tmp_path / "ckpt"
    first = spotguard.Guard(str(root), providers=[]).track(model=torch.nn.Linear(4, 4))
    first.save(3, "periodic")
    jsonl = tmp_path / "m.jsonl"
    g = spotguard.Guard(str(root), every_steps=100, providers=["signal"], interval=0.05, metrics_file=str(jsonl))
    g.track(model=torch.nn.Linear(4, 4))
    assert g.resume() == 3
    root.joinpath("step-00000004").write_text("in the way")
    with g:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert g.preempted.wait(10)
        assert g.step(4)  # the emergency checkpoint fails: step 3 stays the resume point
    resumed, stop = records(jsonl)[0], [r for r in records(jsonl) if r["event"] == "stop"][0]
    assert resumed["event"] == "resume" and resumed["step"] == 3 and resumed["reason"] == "periodic"
    manifest_time = json.loads((root / "step-00000003" / "manifest.json").read_text())["time"]
    assert resumed["checkpoint_time"] == manifest_time
    from datetime import datetime

    assert stop["lost_s"] == pytest.approx(stop["unix"] - datetime.fromisoformat(manifest_time).timestamp(), abs=0.01)


def test_bad_metrics_options_and_a_missing_prometheus_client(tmp_path):
    with pytest.raises(spotguard.ConfigError, match="metrics_port"):
        spotguard.Guard(str(tmp_path), providers=[], metrics_port=70000)
    code = (
        "import sys\nsys.modules['prometheus_client'] = None\nimport spotguard\n"
        f"g = spotguard.Guard({str(tmp_path / 'a')!r}, providers=[], metrics_file={str(tmp_path / 'm.jsonl')!r})\n"
        "g.close()\n"  # JSON lines alone need no extra
        "try:\n"
        f"    spotguard.Guard({str(tmp_path / 'b')!r}, providers=[], metrics_port=0)\n"
        "except spotguard.MissingDependencyError as e:\n    print(e)\n    sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr
    assert "pip install 'spotguard[metrics]'" in proc.stdout
    assert [json.loads(line)["event"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == ["close"]


def test_a_port_in_use_is_a_clear_error(tmp_path):
    g = spotguard.Guard(str(tmp_path / "a"), providers=[], metrics_port=0)
    try:
        with pytest.raises(spotguard.ConfigError, match=f"cannot serve metrics on 127.0.0.1:{g.metrics.port}"):
            spotguard.Guard(str(tmp_path / "b"), providers=[], metrics_port=g.metrics.port)
    finally:
        g.close()


def test_export_into_a_registry_the_user_serves_and_it_leaves_with_the_guard(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from spotguard.metrics import export

    registry = CollectorRegistry()
    guard = spotguard.Guard(str(tmp_path), every_steps=2, providers=[]).track(model=torch.nn.Linear(2, 2))
    exporter = export(guard, registry=registry)
    assert exporter.endpoint is None  # no server of ours
    with guard:
        for step in range(1, 4):
            guard.step(step)
        guard.wait()
        text = generate_latest(registry).decode()
        assert "spotguard_step 3.0" in text and "spotguard_checkpoints_total 1.0" in text
    assert "spotguard_" not in generate_latest(registry).decode()  # unregistered when the guard closed


def test_a_guard_entered_again_is_exported_again_to_the_same_file_and_url(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    g = spotguard.Guard(str(tmp_path / "ckpt"), every_steps=2, providers=[], metrics_port=0, metrics_file=str(jsonl))
    g.track(model=torch.nn.Linear(2, 2))
    url = g.metrics.endpoint.url
    with g:
        g.step(1)
        g.step(2)
    wait_for(lambda: [r["event"] for r in records(jsonl)][-1:] == ["close"])
    with pytest.raises(urllib.error.URLError):
        scrape(url)  # closed between the blocks: nothing of spotguard outlives a block
    with g:  # e.g. the next phase of the job
        g.step(3)
        g.step(4)
        g.wait()
        wait_for(lambda: value(scrape(url), "spotguard_step") == 4)  # the same URL, serving again
        assert value(scrape(url), "spotguard_checkpoints_total") == 2
    events = [(r["event"], r.get("step")) for r in records(jsonl)]
    assert events == [("checkpoint", 2), ("close", 2), ("checkpoint", 4), ("close", 4)]  # appended
    with pytest.raises(urllib.error.URLError):
        scrape(url)


def test_metrics_file_from_the_environment_when_not_given(tmp_path, monkeypatch):
    # How `spotguard rehearse` reads a job's events without a change to its code.
    jsonl = tmp_path / "events.jsonl"
    monkeypatch.setenv("SPOTGUARD_METRICS_FILE", str(jsonl))
    weight = torch.zeros(3)
    guard = spotguard.Guard(str(tmp_path / "ckpt"), every_steps=2, providers=None)
    guard.track(weight=weight).resume()
    with guard:
        for step in range(1, 3):
            weight += 1
            guard.step(step)
    events = [r["event"] for r in records(jsonl)]
    assert events[0] == "resume" and "checkpoint" in events and events[-1] == "close"
    given = tmp_path / "given.jsonl"  # an explicit metrics_file wins
    spotguard.Guard(str(tmp_path / "other"), providers=None, metrics_file=str(given)).track(weight=weight).resume()
    assert given.exists()
