"""The promise of the project: an interrupted-and-resumed run equals an uninterrupted one, bit for bit.

Real processes: the example is started, stopped with a real signal at a random step, started
again, and its per-step losses and final parameters are compared with an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage
from tests.forked import installed
from tests.helpers import (
    EXAMPLE,
    EXAMPLE_ARGS,
    after_step,
    assert_same_run,
    example_cmd,
    read_losses,
    run_example,
    signal_to,
    stop_when,
)

STEPS = EXAMPLE_ARGS[1]
COMMON = EXAMPLE_ARGS
_rng = random.Random()  # the test's own randomness, reported so a failure can be replayed


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with installed(EXAMPLE):  # the example's runs fork from one server: one Python start, one import torch
        yield


def stop_at(
    storage: Path, losses: Path, args: tuple[str, ...], at_step: int, sig: int
) -> subprocess.CompletedProcess[str]:
    """Run the example and send ``sig`` once it has logged ``at_step``; return the finished process."""
    return stop_when(
        example_cmd(storage, *args, "--losses", str(losses), "--step-sleep", "0.03"),
        after_step(losses, at_step),
        signal_to(sig),
    )


@pytest.mark.parametrize("workers", ["0", "2"])
def test_resume_after_sigterm_continues_identically(tmp_path, reference_runs, workers):
    args = (*COMMON, "--num-workers", workers)
    reference = reference_runs(*args)
    at = _rng.randint(3, 80)
    losses, final, storage = tmp_path / "losses.jsonl", tmp_path / "final.pt", tmp_path / "ckpt"

    first = stop_at(storage, losses, args, at, signal.SIGTERM)
    assert first.returncode == EXIT_PREEMPTED, (at, first.stdout, first.stderr)
    stopped = read_losses(losses)[-1][0]
    assert at <= stopped < int(STEPS)
    emergency = [i for i in scan(open_storage(str(storage))) if i.step == stopped]
    assert emergency and emergency[0].manifest and emergency[0].manifest.reason in ("emergency", "periodic")

    second = run_example(storage, *args, "--losses", str(losses), "--final", str(final))
    assert second.returncode == 0, second.stderr
    assert f"resuming at step {stopped}" in second.stdout
    assert_same_run(losses, final, reference)


def test_sigterm_to_the_whole_process_group_stops_cleanly_and_resumes_identically(tmp_path, reference_runs):
    """`timeout`, Slurm and systemd's control group signal every process of the job: the data loader's
    workers die of the SIGTERM too (torch's worker handler), and torch's SIGCHLD handler would then raise
    "DataLoader worker ... is killed by signal" in the training loop or in the emergency save."""
    args = (*COMMON, "--num-workers", "2")
    reference = reference_runs(*args)
    at = _rng.randint(3, 80)
    losses, final, storage = tmp_path / "losses.jsonl", tmp_path / "final.pt", tmp_path / "ckpt"
    first = stop_when(
        example_cmd(storage, *args, "--losses", str(losses), "--step-sleep", "0.03"),
        after_step(losses, at),
        lambda proc: os.killpg(proc.pid, signal.SIGTERM),  # its own session: the example and its workers
    )
    assert first.returncode == EXIT_PREEMPTED and "NOT committed" not in first.stderr, (at, first.stderr[-3000:])
    stopped = read_losses(losses)[-1][0]
    (info,) = [i for i in scan(open_storage(str(storage))) if i.step == stopped]
    assert info.complete and info.manifest is not None and info.manifest.reason in ("emergency", "periodic")
    second = run_example(storage, *args, "--losses", str(losses), "--final", str(final))
    assert second.returncode == 0 and f"resuming at step {stopped}" in second.stdout, second.stderr[-3000:]
    assert_same_run(losses, final, reference)


def test_stop_mid_epoch_and_at_epoch_boundary_with_sigusr1(tmp_path, reference_runs):
    """Slurm's SIGUSR1 works like SIGTERM; stops right at an epoch end resume exactly too."""
    args = (*COMMON, "--num-workers", "0")
    reference = reference_runs(*args)
    losses, final, storage = tmp_path / "losses.jsonl", tmp_path / "final.pt", tmp_path / "ckpt"
    for at in (5, 38, 60):  # 38 = the last batch of the first epoch (608 windows // 16)
        proc = stop_at(storage, losses, args, at, signal.SIGUSR1)
        assert proc.returncode == EXIT_PREEMPTED, (at, proc.stderr)
    done = run_example(storage, *args, "--losses", str(losses), "--final", str(final))
    assert done.returncode == 0, done.stderr
    assert_same_run(losses, final, reference)


def test_second_sigterm_terminates_at_once(tmp_path):
    """A second SIGTERM means 'now': the process dies by the signal, no hanging. (One within half a second
    of the first is the same stop delivered again: tests/notices/test_signals.py.)"""
    losses = tmp_path / "losses.jsonl"

    def twice(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.6)  # past REPEAT_WINDOW; the job may have committed and exited 75 by then
        proc.send_signal(signal.SIGTERM)

    done = stop_when(
        example_cmd(
            tmp_path / "ckpt",
            "--steps",
            "100000",
            "--every-steps",
            "0",
            "--num-workers",
            "0",
            "--losses",
            str(losses),
            "--step-sleep",
            "0.05",
        ),
        after_step(losses, 1),
        twice,
    )
    assert done.returncode in (-signal.SIGTERM, EXIT_PREEMPTED), done.stderr[-3000:]
