"""Accelerate + AcceleratorGuard: stopped by SIGTERM, a cloud notice, during an evaluation and during
warm-up, resumed each time with load_state, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import random

import pytest

from . import runs

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

SCRIPT = "accelerate_train.py"
STEPS = 70
# 32 batches per epoch: the run crosses two epoch ends; saves every 15 steps, evaluations (4 batches,
# dropout on and noisy inputs: random draws) every 16, at each epoch's end too.
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "16", "--eval-augment", "--interval", "0.2")
_rng = random.Random()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("accelerate-reference"), *ARGS)


def test_accelerate_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    runs.stop_by_signal_then_cloud_notice(SCRIPT, tmp_path, ARGS, STEPS, mock_metadata, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)


def test_accelerate_notice_during_evaluation_and_warmup_still_checkpoints(tmp_path, reference):
    # At an epoch's last step: the resumed run evaluates again with the same draws, then begins the next epoch.
    runs.stop_during_evaluation_then_warmup(SCRIPT, tmp_path, ARGS, [32], 4, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
