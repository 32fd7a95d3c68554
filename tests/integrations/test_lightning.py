"""Lightning + SpotguardCallback: stopped by SIGTERM, a cloud notice, during validation and during
warm-up, resumed each time with ckpt_path, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import random

import pytest

from . import runs

pytest.importorskip("lightning")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

SCRIPT = "lightning_train.py"
STEPS = 70
# 32 batches per epoch: the run crosses two epoch ends; saves every 15 steps, validations (4 batches) every 10.
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "10", "--interval", "0.2")
# Validations that draw random numbers (noisy inputs). Not in ARGS: a checkpoint at a step that also
# validates (30, 60: the save comes first) resumes past that validation (Lightning skips it), so its
# draws are missing from the resumed run: a known gap (docs/integrations.md).
AUGMENTED = (*ARGS, "--eval-augment")
_rng = random.Random()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("lightning-reference"), *ARGS)


def test_lightning_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    runs.stop_by_signal_then_cloud_notice(SCRIPT, tmp_path, ARGS, STEPS, mock_metadata, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)


@pytest.fixture(scope="module")
def reference_augmented(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("lightning-reference-augmented"), *AUGMENTED)


def test_lightning_notice_during_validation_and_warmup_still_checkpoints(tmp_path, reference_augmented):
    # Not at 30 or 60: there the periodic checkpoint, written before the validation, is already the step's.
    # The cut validation draws random numbers: the resume repeats it whole, from the streams it began with.
    in_eval = runs.stop_during_evaluation_then_warmup(SCRIPT, tmp_path, AUGMENTED, [20, 40], 4, _rng)
    assert "during validation" in in_eval.stderr
    runs.finish_identically(SCRIPT, tmp_path, AUGMENTED, reference_augmented)
