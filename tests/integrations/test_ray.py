"""examples/ray/train_ray.py on a local Ray cluster: a notice to one worker stops both after the same
step, Ray Train restarts the worker group (FailureConfig), and the resumed run equals an uninterrupted
one bit for bit (every step's loss on both ranks, the final weights and optimizer state).

Each run is the example as a user starts it, `python examples/ray/train_ray.py --local-cpus 2`, in a
session of its own: Ray's processes (gcs_server, raylet, the workers) live in that session, and none
may be left once the run is over.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from spotguard.checkpoint import CheckpointInfo, scan
from spotguard.storage import open_storage

from ..conftest import _computed_once
from ..helpers import REPO, WAIT_S, assert_same_run, last_step, read_jsonl, read_losses, subprocess_env

pytest.importorskip("ray.train")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = REPO / "examples" / "ray" / "train_ray.py"
STEPS = 60  # 32 batches per epoch and rank: the run crosses an epoch end
ARGS = ("--steps", str(STEPS), "--every-steps", "20", "--interval", "0.2")
SLOW = ("--step-sleep", "0.05")  # the stopped run: a notice sent after step N lands a few steps later
_rng = random.Random()


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            found.append(int(entry.name))
    return found


def _reap(sid: int, grace: float = 5.0) -> list[str]:
    """Wait ``grace`` s for Ray's processes in the session to go, then kill the rest; returns what was killed."""
    deadline = time.monotonic() + grace
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for pid in _session(sid):
        try:
            killed.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120])
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return killed


@dataclass
class Run:
    done: subprocess.CompletedProcess[str]
    left: list[str]  # processes of the driver's session alive 5 s after it exited (killed then)
    committed: list[CheckpointInfo]  # the checkpoints in storage when the ranks had stopped for the notice


def _run(run_dir: Path, notice_after: int | None = None) -> Run:
    """One run of the example; with ``notice_after``, a notice file for rank 1 once rank 1 logged that step,
    removed once the ranks stopped (before Ray's restart polls it, or the restart stops once more)."""
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's unix sockets need a short path
    notice = run_dir / "notice-1"
    env = subprocess_env(
        SPOTGUARD_NOTICE_FILE=str(run_dir / "notice-{rank}"),
        RAY_TMPDIR=ray_tmp,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # on Linux too: the node's address is 127.0.0.1, not the NIC's
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",  # no token written to ~/.ray
        RAY_DEDUP_LOGS="0",
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5",  # the controller sees the stopped workers sooner (default 2)
    )
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--storage",
        str(run_dir / "ckpt"),
        "--results",
        str(run_dir / "ray-results"),
        "--local-cpus",
        "2",
        "--losses",
        str(run_dir / "losses-{rank}.jsonl"),
        "--trace",
        str(run_dir / "trace-{rank}.jsonl"),
        "--final",
        str(run_dir / "final.pt"),
        *ARGS,
        *(SLOW if notice_after is not None else ()),
    ]
    committed: list[CheckpointInfo] = []
    with open(run_dir / "out.txt", "w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=run_dir, start_new_session=True)
        try:
            deadline = time.monotonic() + 2 * WAIT_S
            while proc.poll() is None and time.monotonic() < deadline:
                if (
                    notice_after is not None
                    and not notice.exists()
                    and (last_step(run_dir / "losses-1.jsonl") or 0) >= notice_after
                ):
                    notice.touch()
                    notice_after = None
                if notice.exists() and any(e["event"] == "preempted" for e in read_jsonl(run_dir / "trace-1.jsonl")):
                    notice.unlink()
                    # committed before the ranks raised; later saves of the resumed run may rotate it out (keep=3)
                    committed.extend(scan(open_storage(str(run_dir / "ckpt"))))
                time.sleep(0.01)
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
    return Run(subprocess.CompletedProcess(cmd, proc.returncode, text, ""), left, committed)


def _attempts(run_dir: Path, rank: int) -> list[dict]:
    """The rank's attempts in order: {"begin": step, "pid": pid, "stopped": step or None}."""
    attempts: list[dict] = []
    for e in read_jsonl(run_dir / f"trace-{rank}.jsonl"):
        if e["event"] == "train_begin":
            attempts.append({"begin": e["step"], "pid": e["pid"], "stopped": None})
        else:
            attempts[-1]["stopped"] = e["step"]
    return attempts


def reference_run(factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (``_run`` without a notice), once per test run: this file and
    test_ray_drain.py compare with the same one (a Ray run is half a minute of process starts). It
    exited 0, in one attempt, and left no Ray process behind."""

    def compute(ref: Path) -> None:
        done = _run(ref)
        outcome = {"returncode": done.done.returncode, "out": done.done.stdout[-6000:], "left": done.left}
        (ref / "outcome.json").write_text(json.dumps(outcome))

    ref = _computed_once(factory, "ray-reference", compute)
    outcome = json.loads((ref / "outcome.json").read_text())
    assert outcome["returncode"] == 0, outcome["out"]
    assert not outcome["left"], f"Ray processes outlived the driver: {outcome['left']}"
    assert [a["begin"] for a in _attempts(ref, 0)] == [0]
    return ref


def test_ray_train_notice_to_one_worker_restarts_both_and_resumes_identically(tmp_path, tmp_path_factory):
    at = _rng.randint(5, 30)
    reference, cut_dir = reference_run(tmp_path_factory), tmp_path / "cut"
    cut_dir.mkdir()
    cut = _run(cut_dir, notice_after=at)
    out = cut.done.stdout
    assert cut.done.returncode == 0, out[-6000:]
    assert "stop notice from file" in out and "stop notice from peer" in out, out[-6000:]

    # Both ranks stopped after the same step, in the first attempt; Ray started new worker processes
    # that resumed there (a restart that raced the notice's removal stops once more, at once: allowed).
    ranks = [_attempts(cut_dir, rank) for rank in (0, 1)]
    assert [(a["begin"], a["stopped"]) for a in ranks[0]] == [(a["begin"], a["stopped"]) for a in ranks[1]], ranks
    first, *restarts = ranks[0]
    stopped = first["stopped"]
    assert first["begin"] == 0 and stopped is not None and at <= stopped < STEPS, ranks
    assert restarts and restarts[0]["begin"] == stopped, ranks
    for attempts in ranks:
        assert len({a["pid"] for a in attempts}) == len(attempts)  # every attempt a new worker process
        for before, after in zip(attempts, attempts[1:], strict=False):
            assert after["begin"] == before["stopped"]
    assert restarts[-1]["stopped"] is None

    (info,) = [i for i in cut.committed if i.step == stopped]
    assert info.complete and info.manifest is not None and info.manifest.reason == "emergency", info

    for rank in (0, 1):
        want = (read_losses(reference / f"losses-{rank}.jsonl"), reference / "final.pt")
        assert_same_run(cut_dir / f"losses-{rank}.jsonl", cut_dir / "final.pt", want)
    assert not cut.left, f"Ray processes outlived the driver: {cut.left}"
