"""examples/ray/train_ray.py on a real local multi-node Ray cluster (tests/workers/ray_cluster.py: two nodes of
one CPU worker each), one node reclaimed the way Ray sees it: a drain through the GCS with
DRAIN_NODE_REASON_PREEMPTION and a deadline, or SIGTERM to a `ray start --block` node. Ray's notice reaches
both workers (polled inside the ranks' step vote), both stop after the same step, the emergency checkpoint
commits before Ray's deadline, Ray restarts the group within its preemption budget (max_failures is 0: an
attempt charged to it would end the run), and the resumed run equals an uninterrupted one bit for bit.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from spotguard.checkpoint import CheckpointInfo, scan
from spotguard.storage import open_storage

from ..helpers import WAIT_S, WORKERS, assert_same_run, read_jsonl, read_losses, subprocess_env
from .test_ray import ARGS as RAY_ARGS
from .test_ray import STEPS, _attempts, _reap, reference_run

pytest.importorskip("ray.train")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = (*RAY_ARGS, "--max-failures", "0")  # test_ray.py's: its uninterrupted run is the reference here too
AT = 25  # the reclaim comes once rank 1 logged this step (a periodic checkpoint of step 20 exists by then)


def _env(run_dir: Path, ray_tmp: str) -> dict[str, str]:
    return subprocess_env(
        RAY_TMPDIR=ray_tmp,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        RAY_DEDUP_LOGS="0",
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5",
        RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.2",  # Ray's drain watcher (default 5 s)
    )


def _run(run_dir: Path, cmd: list[str]) -> tuple[subprocess.CompletedProcess[str], list[CheckpointInfo], list[str]]:
    """Run ``cmd`` in a session of its own; the checkpoints in storage once both ranks logged their stop."""
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    committed: list[CheckpointInfo] = []
    with open(run_dir / "out.txt", "w+") as out:
        proc = subprocess.Popen(
            cmd, env=_env(run_dir, ray_tmp), stdout=out, stderr=subprocess.STDOUT, cwd=run_dir, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 2 * WAIT_S
            while proc.poll() is None and time.monotonic() < deadline:
                stopped = all(
                    any(e["event"] == "preempted" for e in read_jsonl(run_dir / f"trace-{r}.jsonl")) for r in (0, 1)
                )
                if stopped and not committed:
                    committed = scan(open_storage(str(run_dir / "ckpt")))
                time.sleep(0.05)
            timed_out = proc.poll() is None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            left = _reap(proc.pid)
            shutil.rmtree(ray_tmp, ignore_errors=True)
        out.seek(0)
        text = out.read()
    assert not timed_out, f"still running after {2 * WAIT_S:.0f}s\n{text[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, text, ""), committed, left


def _example_args(run_dir: Path) -> list[str]:
    return [
        "--storage",
        str(run_dir / "ckpt"),
        "--results",
        str(run_dir / "ray-results"),
        "--losses",
        str(run_dir / "losses-{rank}.jsonl"),
        "--trace",
        str(run_dir / "trace-{rank}.jsonl"),
        "--final",
        str(run_dir / "final.pt"),
        *ARGS,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (2 ranks on one local node train as 2 nodes of 1 rank do): test_ray.py's,
    computed once for both files (the same example, steps, saves and seed)."""
    return reference_run(tmp_path_factory)


def _reclaimed(
    tmp_path: Path, *how: str, max_failures: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[CheckpointInfo], int]:
    """``max_failures=0``: Ray must charge the attempt to its preemption budget (else the run ends)."""
    example = [*_example_args(tmp_path), "--step-sleep", "0.05", "--max-failures", str(max_failures)]
    cmd = [sys.executable, str(WORKERS / "ray_cluster.py"), str(tmp_path), *how, "--", *example]
    done, committed, left = _run(tmp_path, cmd)
    out = done.stdout
    assert done.returncode == 0, out[-8000:]
    assert not left, f"Ray processes outlived the driver: {left}"
    ranks = [_attempts(tmp_path, rank) for rank in (0, 1)]
    assert [(a["begin"], a["stopped"]) for a in ranks[0]] == [(a["begin"], a["stopped"]) for a in ranks[1]], ranks
    (first, *restarts) = ranks[0]
    stopped = first["stopped"]
    assert first["begin"] == 0 and stopped is not None and AT <= stopped < STEPS, ranks
    assert restarts and restarts[0]["begin"] == stopped and restarts[-1]["stopped"] is None, ranks
    for rank in (0, 1):  # both learnt it from Ray, the drained node's rank and the other
        (event,) = [e for e in read_jsonl(tmp_path / f"trace-{rank}.jsonl") if e["event"] == "preempted"]
        assert event["by"] == "ray", event
    assert "stop notice from ray (preempt)" in out, out[-8000:]
    if max_failures == 0:  # Ray charged the attempt to max_preemption_failures: else the run would have ended
        assert "Source: preemption" in out and "Source: worker group" not in out, out[-8000:]
    return done, committed, stopped


def test_ray_drain_stops_both_workers_commits_before_deadline_and_resumes_identically(tmp_path, reference):
    done, committed, stopped = _reclaimed(tmp_path, "--drain-after", str(AT), "--deadline", "6")
    deadline = dt.datetime.fromtimestamp(json.loads((tmp_path / "drain.json").read_text())["deadline"], dt.timezone.utc)
    (info,) = [i for i in committed if i.step == stopped]
    assert info.complete and info.manifest is not None and info.manifest.reason == "emergency", info
    assert dt.datetime.fromisoformat(info.manifest.time) < deadline, (info.manifest.time, deadline)
    for rank in (0, 1):
        want = (read_losses(reference / f"losses-{rank}.jsonl"), reference / "final.pt")
        assert_same_run(tmp_path / f"losses-{rank}.jsonl", tmp_path / "final.pt", want)


def test_ray_sigterm_to_a_ray_start_block_node_drains_it_and_the_same_stop_follows(tmp_path, reference):
    if not (Path(sys.executable).parent / "ray").exists():
        pytest.skip("no `ray` command beside this Python")
    # Which budget Ray charges is Ray's race here, not spotguard's: a `ray start --block` node drains and exits
    # once idle, dying "expectedly: received SIGTERM", and unless Ray's controller polled the drain first (0.2 s)
    # the attempt counts as a worker-group failure (seen in 2 of 4 loaded CI runs). One is allowed; the stop,
    # the commit and the exact resume are what is checked.
    _, committed, stopped = _reclaimed(tmp_path, "--sigterm-after", str(AT), "--deadline", "6", max_failures=1)
    (info,) = [i for i in committed if i.step == stopped]
    assert info.complete and info.manifest is not None and info.manifest.reason == "emergency", info
    for rank in (0, 1):
        want = (read_losses(reference / f"losses-{rank}.jsonl"), reference / "final.pt")
        assert_same_run(tmp_path / f"losses-{rank}.jsonl", tmp_path / "final.pt", want)


def test_ray_drain_shorter_than_the_save_resumes_from_the_last_committed_checkpoint(tmp_path, reference):
    example = [*_example_args(tmp_path), "--step-sleep", "0.05"]
    how = ["--drain-after", str(AT), "--deadline", "3", "--slow-emergency", "8"]  # the save outlasts the deadline
    cmd = [sys.executable, str(WORKERS / "ray_cluster.py"), str(tmp_path), *how, "--", *example]
    done, _, left = _run(tmp_path, cmd)
    out = done.stdout
    assert done.returncode == 0, out[-8000:]
    assert not left, f"Ray processes outlived the driver: {left}"
    # Each rank said what stands while the save runs; Ray ended the attempt at its deadline, before it committed.
    said = r"pid=(\d+)\)\S*\s+emergency checkpoint of step (\d+): [^\n]*until it commits the resume point is step 20"
    kept = set(re.findall(said, out))  # {(worker pid, stop step)}: Ray may echo a line twice
    assert len({pid for pid, _ in kept}) == 2 and len({int(s) for _, s in kept}) == 1, out[-8000:]
    assert min(int(s) for _, s in kept) >= AT, kept
    assert not re.search(r"emergency checkpoint of step \d+ committed", out), out[-8000:]
    assert "Source: preemption" in out and "Source: worker group" not in out, out[-8000:]
    for rank in (0, 1):
        first, *restarts = _attempts(tmp_path, rank)
        assert first == {"begin": 0, "pid": first["pid"], "stopped": None}, first  # killed inside the save
        assert restarts and restarts[0]["begin"] == 20 and restarts[-1]["stopped"] is None, restarts
    assert all(
        i.manifest is None or i.manifest.reason != "emergency" for i in scan(open_storage(str(tmp_path / "ckpt")))
    )
    for rank in (0, 1):
        want = (read_losses(reference / f"losses-{rank}.jsonl"), reference / "final.pt")
        assert_same_run(tmp_path / f"losses-{rank}.jsonl", tmp_path / "final.pt", want)
