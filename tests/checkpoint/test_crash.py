"""SIGKILL at any moment, in the middle of a save included, never breaks the next resume."""

from __future__ import annotations

import json
import random
import signal
import sys

import pytest
import torch

from tests.helpers import WORKERS, read_losses, run

pytestmark = pytest.mark.slow

# A wider model makes each save take long enough to be hit; a save every 2 steps.
ARGS = ("--steps", "70", "--every-steps", "2", "--keep", "2", "--num-workers", "0", "--width", "192")
DRIVER = WORKERS / "crash_example.py"  # examples/train.py forked from one process that imported it: no imports per run


def test_sigkill_at_random_moments_never_breaks_resume(tmp_path, reference_runs):
    ref_losses, ref_final = reference_runs(*ARGS)  # a run of the example as its own process
    ref = dict(ref_losses)
    seed = random.randrange(2**32)
    storage, losses, final = tmp_path / "ckpt", tmp_path / "losses.jsonl", tmp_path / "final.pt"
    # 8 runs, each SIGKILLed: odd ones while a save is half written, even ones at a random moment.
    proc = run([sys.executable, str(DRIVER), str(storage), str(losses), "8", str(seed), "--", *ARGS])
    assert proc.returncode == 0, (seed, proc.stderr[-3000:])  # a complete checkpoint failed to verify
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for kill in summary["rounds"]:
        assert kill["code"] in (-signal.SIGKILL, 0), (seed, kill["code"], kill["stderr"])
        assert not kill["corrupt"], (seed, kill["corrupt"])
    assert summary["final"] == 0, (seed, summary["final_stderr"])
    # Every step ever logged, replays after a kill included, equals the uninterrupted run.
    logged = read_losses(losses)
    assert len(logged) >= len(ref_losses)
    for step, loss in logged:
        assert loss == ref[step], (seed, step)
    assert {s for s, _ in logged} == set(ref)
    a, b = torch.load(final, weights_only=True), torch.load(ref_final, weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in b)
    partial = sum(kill["partial"] for kill in summary["rounds"])
    assert partial >= 1, "no kill landed during a save: the test did not exercise what it should"
