"""Running a trainer example as a real process, stopping it at a chosen moment, comparing with a reference.

Every trainer test follows the same story as tests/test_resume.py: an uninterrupted reference run,
then runs of the same command stopped by a real SIGTERM or a notice from the mock metadata server,
each resumed by the next, and the per-step losses and final parameters compared bit for bit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import CheckpointInfo, scan
from spotguard.storage import open_storage

from ..helpers import REPO, read_losses, subprocess_env

WAIT_S = 240  # a loaded 2-core machine imports a trainer in tens of seconds


def command(script: str, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "examples" / script), "--storage", str(run_dir / "ckpt"),
            "--losses", str(run_dir / "losses.jsonl"), "--trace", str(run_dir / "trace.jsonl"), "--quiet", *args]


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(script: str, run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(script, run_dir, *args), env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=WAIT_S)


def stop_when(script: str, run_dir: Path, args: tuple[str, ...], ready: Callable[[], bool],
              stop: Callable[[subprocess.Popen], None], env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    """Start the example, call ``stop(proc)`` once ``ready()`` holds, and return the finished process."""
    proc = subprocess.Popen(command(script, run_dir, *args), env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                out, err = proc.communicate()
                raise AssertionError(f"the run ended (or hung) before the moment to stop it: {proc.returncode}\n"
                                     f"{out}\n{err[-4000:]}")
            time.sleep(0.005)
        stop(proc)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def after_step(run_dir: Path, step: int) -> Callable[[], bool]:
    losses = run_dir / "losses.jsonl"
    return lambda: bool(read_losses(losses)) and read_losses(losses)[-1][0] >= step


def sigterm(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)


def checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    return scan(open_storage(str(run_dir / "ckpt")))


def assert_stopped(proc: subprocess.CompletedProcess[str], run_dir: Path, reason: str = "emergency") -> int:
    """Exit 75 and a committed checkpoint of the last logged step; returns that step."""
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, proc.stdout, proc.stderr[-4000:])
    stopped = read_losses(run_dir / "losses.jsonl")[-1][0]
    (info,) = [i for i in checkpoints(run_dir) if i.step == stopped]
    assert info.complete and info.manifest is not None and info.manifest.reason == reason, info
    return stopped


def reference_run(script: str, run_dir: Path, *args: str) -> tuple[list[tuple[int, float]], Path]:
    done = run(script, run_dir, *args, "--final", str(run_dir / "final.pt"))
    assert done.returncode == 0, done.stderr[-4000:]
    return read_losses(run_dir / "losses.jsonl"), run_dir / "final.pt"
