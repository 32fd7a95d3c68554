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
import torch

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage
from tests.helpers import example_cmd, read_losses, run_example, subprocess_env

pytestmark = pytest.mark.slow

STEPS = "90"
# ~38 batches per epoch: 90 steps cover two epoch boundaries.
COMMON = ("--steps", STEPS, "--every-steps", "20", "--batch-size", "16")
_rng = random.Random()  # the test's own randomness, reported so a failure can be replayed


def stop_at(storage: Path, losses: Path, args: tuple[str, ...], at_step: int, sig: int) -> subprocess.CompletedProcess[str]:
    """Run the example and send ``sig`` once it has logged ``at_step``; return the finished process."""
    proc = subprocess.Popen(example_cmd(storage, *args, "--losses", str(losses), "--step-sleep", "0.03"),
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if read_losses(losses) and read_losses(losses)[-1][0] >= at_step:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_same_run(losses_path: Path, final: Path, reference) -> None:
    ref_losses, ref_final = reference
    got = read_losses(losses_path)
    by_step: dict[int, float] = {}
    for step, loss in got:  # replayed steps must equal the uninterrupted run too
        assert loss == dict(ref_losses)[step], f"step {step}: {loss!r} != {dict(ref_losses)[step]!r}"
        by_step[step] = loss
    assert sorted(by_step.items()) == ref_losses
    a, b = torch.load(final, weights_only=True), torch.load(ref_final, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


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
    """A second SIGTERM means 'now': the process dies by the signal, no hanging."""
    losses = tmp_path / "losses.jsonl"
    proc = subprocess.Popen(example_cmd(tmp_path / "ckpt", "--steps", "100000", "--every-steps", "0",
                                        "--num-workers", "0", "--losses", str(losses), "--step-sleep", "0.05"),
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not read_losses(losses):
            time.sleep(0.01)
            assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode in (-signal.SIGTERM, EXIT_PREEMPTED)
