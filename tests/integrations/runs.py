"""Running a trainer example as a real process, stopping it at a chosen moment, comparing with a reference.

Every trainer test follows the same story as tests/guard/test_resume.py: an uninterrupted reference run,
then runs of the same command stopped by a real SIGTERM or a notice from the mock metadata server,
each resumed by the next, and the per-step losses and final parameters compared bit for bit.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import CheckpointInfo, scan
from spotguard.storage import open_storage

from .. import helpers
from ..forked import installed
from ..helpers import REPO, after_step, assert_same_run, read_jsonl, read_losses, signal_to, subprocess_env

SLOW = ("--step-sleep", "0.05")  # a notice sent after step N lands before step N + 2


def command(script: str, run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        str(REPO / "examples" / script),
        "--storage",
        str(run_dir / "ckpt"),
        "--losses",
        str(run_dir / "losses.jsonl"),
        "--trace",
        str(run_dir / "trace.jsonl"),
        "--quiet",
        *args,
    ]


@contextlib.contextmanager
def forked(script: str) -> Iterator[None]:
    """While inside, every run of the example forks from one server that imported it once
    (tests/forked.py): its Python start and imports (torch, the trainer's library) cost seconds a run."""
    with installed(REPO / "examples" / script):
        yield


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "trace.jsonl")


def run(script: str, run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return helpers.run(command(script, run_dir, *args), env=env, cwd=run_dir)


def stop_when(
    script: str,
    run_dir: Path,
    args: tuple[str, ...],
    ready: Callable[[], bool],
    stop: Callable[[subprocess.Popen], object],
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Start the example, call ``stop(proc)`` once ``ready()`` holds, and return the finished process."""
    return helpers.stop_when(command(script, run_dir, *args), ready, stop, env=env, cwd=run_dir)


sigterm = signal_to(signal.SIGTERM)


def checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    return scan(open_storage(str(run_dir / "ckpt")))


def assert_stopped(proc: subprocess.CompletedProcess[str], run_dir: Path, reason: str = "emergency") -> int:
    """Exit 75 and a committed checkpoint of the last logged step; returns that step."""
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, proc.stdout, proc.stderr[-4000:])
    stopped = read_losses(run_dir / "losses.jsonl")[-1][0]
    (info,) = [i for i in checkpoints(run_dir) if i.step == stopped]
    # A notice that lands on a step whose periodic checkpoint was just committed is not written twice.
    again = re.search(rf"at step {stopped}: (it is )?already checkpointed", proc.stderr)
    expected = {reason, "periodic"} if again else {reason}
    assert info.complete and info.manifest is not None and info.manifest.reason in expected, info
    return stopped


def reference_run(script: str, run_dir: Path, *args: str) -> tuple[list[tuple[int, float]], Path]:
    done = run(script, run_dir, *args, "--final", str(run_dir / "final.pt"))
    assert done.returncode == 0, done.stderr[-4000:]
    return read_losses(run_dir / "losses.jsonl"), run_dir / "final.pt"


def stop_by_signal_then_cloud_notice(
    script: str, run_dir: Path, args: tuple[str, ...], steps: int, mock_metadata, rng
) -> int:
    """A real SIGTERM at a random step, then (resumed) a notice from the AWS mock at a later random step.

    Both runs must exit 75 with an emergency checkpoint of their last step; returns that step.
    """
    from spotguard.ops.cli import main as spotguard_main
    from spotguard.ops.mockmeta import endpoint_env

    at = rng.randint(2, steps // 2 - 3)
    first = stop_when(script, run_dir, (*args, *SLOW), after_step(run_dir / "losses.jsonl", at), sigterm)
    stopped = assert_stopped(first, run_dir)
    assert at <= stopped < steps

    server = mock_metadata("aws")
    env = subprocess_env(**endpoint_env("aws", server.url))
    at = rng.randint(stopped + 2, steps - 5)
    second = stop_when(
        script,
        run_dir,
        (*args, *SLOW, "--providers", "signal,aws"),
        after_step(run_dir / "losses.jsonl", at),
        lambda proc: spotguard_main(["simulate-preemption", "--cloud", "aws", "--endpoint", server.url]),
        env=env,
    )
    assert "notice from aws" in second.stdout, second.stdout
    stopped = assert_stopped(second, run_dir)
    assert at <= stopped < steps
    # The AWS notice carries a deadline: the commit reports its margin (unless the stop step was
    # just committed by a periodic save, one in 15 here: then nothing is written twice).
    assert "before the deadline" in second.stderr or "already checkpointed" in second.stderr, second.stderr[-3000:]
    return stopped


def stop_during_evaluation_then_warmup(
    script: str, run_dir: Path, args: tuple[str, ...], eval_steps: list[int], eval_batches: int, rng
) -> subprocess.CompletedProcess[str]:
    """SIGTERM while an evaluation runs (it is cut short, the step is checkpointed), then, resumed,
    SIGTERM during the warm-up before the first step (nothing new to save: stop at the resume point)."""
    at = rng.choice(eval_steps)

    def in_eval() -> bool:
        return any(e["event"] == "eval_batch" and e["step"] == at for e in events(run_dir))

    # Only the chosen evaluation is slowed: the ones before it run at full speed.
    slow_eval = ("--eval-sleep", "2", "--eval-sleep-step", str(at))
    first = stop_when(script, run_dir, (*args, *SLOW, *slow_eval), in_eval, sigterm)
    assert assert_stopped(first, run_dir) == at
    batches = [e for e in events(run_dir) if e["event"] == "eval_batch" and e["step"] == at]
    assert len(batches) < eval_batches  # cut short: the checkpoint did not wait for the whole evaluation

    def began_twice() -> bool:
        return sum(e["event"] == "train_begin" for e in events(run_dir)) == 2

    second = stop_when(script, run_dir, (*args, *SLOW, "--warmup-sleep", "1"), began_twice, sigterm)
    assert assert_stopped(second, run_dir) == at  # nothing trained since the resume point
    assert "already checkpointed" in second.stderr
    assert max(i.step for i in checkpoints(run_dir)) == at
    return first


def finish_identically(
    script: str, run_dir: Path, args: tuple[str, ...], reference
) -> subprocess.CompletedProcess[str]:
    """The last, uninterrupted resume: losses of every step and the final parameters equal the reference."""
    last = run(script, run_dir, *args, "--final", str(run_dir / "final.pt"))
    assert last.returncode == 0, last.stderr[-4000:]
    assert_same_run(run_dir / "losses.jsonl", run_dir / "final.pt", reference)
    return last
