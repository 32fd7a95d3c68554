"""``spotguard run``'s restarts and their causes: real child processes, a real endpoint, JSON lines and --json."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from spotguard import EXIT_PREEMPTED
from tests.metrics.test_guard import value

from ..helpers import free_port, subprocess_env

pytestmark = pytest.mark.slow

#: One job, a different fate per start (counted in a file): crash, killed by a signal, hang before its
#: first step, hang after a step, then (start 5) scrape the supervisor's endpoint and stop for a notice.
JOB = textwrap.dedent("""
    import mmap, os, struct, sys, time, urllib.request
    count_file, port, scraped = sys.argv[1], sys.argv[2], sys.argv[3]
    n = int(open(count_file).read()) + 1 if os.path.exists(count_file) else 1
    open(count_file, "w").write(str(n))
    with open(os.environ["SPOTGUARD_HEARTBEAT"], "r+b") as f:
        beat = mmap.mmap(f.fileno(), 16)
    if n == 1:
        sys.exit(3)
    if n == 2:
        os.kill(os.getpid(), 9)
    if n == 3:
        time.sleep(60)  # no step at all: the startup timeout
    if n == 4:
        struct.pack_into("=q", beat, 0, 7)  # step 7 done, then nothing: a hang
        time.sleep(60)
    struct.pack_into("=q", beat, 0, 9)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        open(scraped, "w").write(answer.read().decode())
    print("this goes to stderr under --json")
    sys.exit(75)
""")


def test_restarts_by_cause_on_the_endpoint_in_json_lines_and_the_json_summary(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    job, scraped, jsonl = tmp_path / "job.py", tmp_path / "scraped.txt", tmp_path / "run.jsonl"
    job.write_text(JOB)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "spotguard",
        "run",
        "--storage",
        str(tmp_path / "ckpt"),
        "--backoff",
        "0.05",
        "--hang-timeout",
        "1.5",
        "--json",
        "--metrics-port",
        str(port),
        "--metrics-file",
        str(jsonl),
        "--",
        sys.executable,
        str(job),
        str(tmp_path / "count"),
        str(port),
        str(scraped),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr

    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(scraped.read_text())
        for s in f.samples
    }
    assert value(got, "spotguard_run_starts_total") == 5
    for cause in ("exit_code", "signal", "startup_timeout", "hang"):
        assert value(got, "spotguard_run_restarts_total", cause=cause) == 1, cause
        assert value(got, "spotguard_run_exits_total", cause=cause) == 1, cause
    assert value(got, "spotguard_run_exits_total", cause="preempted") == 0  # not yet: it is running
    assert value(got, "spotguard_run_job_running") == 1 and value(got, "spotguard_run_job_step") == 9
    assert value(got, "spotguard_run_last_exit_code") == 140  # the hang: SIGUSR2 (stack dump) killed it
    assert value(got, "spotguard_run_lost_seconds_count") == 4

    summary = json.loads(proc.stdout)  # exactly one document: the job's print went to stderr
    assert "this goes to stderr under --json" in proc.stderr
    assert summary["exit_code"] == EXIT_PREEMPTED and summary["outcome"] == "preempted"
    assert summary["restarts"] == 4 and summary["starts"] == 5 and summary["error"] is None
    assert summary["restart_causes"] == {"exit_code": 1, "signal": 1, "startup_timeout": 1, "hang": 1}
    exits = summary["exits"]
    assert [(e["cause"], e["exit_code"], e["signal"], e["restart"]) for e in exits] == [
        ("exit_code", 3, None, True),
        ("signal", 137, "SIGKILL", True),
        # A hung job gets SIGUSR2 to dump its stacks; this one has no handler (no Guard) and dies of it.
        ("startup_timeout", 140, "SIGUSR2", True),
        ("hang", 140, "SIGUSR2", True),
        ("preempted", 75, None, False),
    ]
    assert [e["step"] for e in exits] == [0, 0, 0, 7, 9]
    assert all(e["lost_s"] is not None and 0 <= e["lost_s"] <= e["seconds"] + 0.1 for e in exits)
    assert exits[2]["seconds"] >= 1.5 and exits[3]["seconds"] >= 1.5  # the watchdog's timeouts

    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["event"] for r in recs] == ["start", "exit"] * 5 + ["end"]
    assert [r["cause"] for r in recs if r["event"] == "exit"] == [e["cause"] for e in exits]
    assert recs[-1]["exit_code"] == EXIT_PREEMPTED and recs[-1]["restarts"] == 4


def test_json_summary_when_the_restart_budget_is_used_up(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "spotguard",
        "run",
        "--storage",
        str(tmp_path / "ckpt"),
        "--backoff",
        "0.05",
        "--max-restarts",
        "1",
        "--json",
        "--",
        sys.executable,
        "-c",
        "import sys; sys.exit(4)",
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["exit_code"] == 2 and summary["outcome"] == "gave_up" and summary["restarts"] == 1
    assert "restart budget is used up" in summary["error"] and "restart budget is used up" in proc.stderr
    assert [(e["cause"], e["exit_code"], e["restart"]) for e in summary["exits"]] == [
        ("exit_code", 4, True),
        ("exit_code", 4, False),
    ]
