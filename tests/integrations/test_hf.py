"""Hugging Face Trainer + SpotguardCallback: stopped by SIGTERM, a cloud notice, during an evaluation and
during warm-up, resumed each time, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from spotguard.ops.rehearsal.compare import compare

from ..helpers import after_step
from . import runs

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = "hf_trainer.py"
STEPS = 40
# Saves every 15 steps, evaluations (4 batches) every 10, 32 batches per epoch: notices meet saves,
# evaluations and an epoch end. The evaluations draw random numbers (test-time augmentation).
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "10", "--interval", "0.2", "--eval-augment")
_rng = random.Random()  # the test's own randomness


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with runs.forked(SCRIPT):  # the example's runs fork from one server: one start, one import of each library
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hf-reference")
    return runs.reference_run(SCRIPT, run_dir, *ARGS, "--output-dir", str(run_dir / "hf-output"))


def plant_broken_checkpoints(run_dir, good_step: int) -> Path:
    """What a kill mid-save leaves: newer folders without a manifest, or whose files fail their checksums.

    They sit just past the stop step (which may be the run's last but one), so the resumed run also
    saves over them when it gets there. Returns the folder without a manifest.
    """
    good = run_dir / "ckpt" / f"step-{good_step:08d}"
    cut = run_dir / "ckpt" / f"step-{good_step + 2:08d}"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    bad = run_dir / "ckpt" / f"step-{good_step + 1:08d}"
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["step"] = good_step + 1
    (bad / "manifest.json").unlink()
    (bad / "manifest.json").write_text(json.dumps(manifest))
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (bad / "model.safetensors").unlink()  # may be a hard link of the good one: replace, never edit
    (bad / "model.safetensors").write_bytes(bytes(weights))
    # The Trainer's own folder: a checkpoint-N cut short, the one `resume_from_checkpoint=True` would take.
    (run_dir / "hf-output" / f"checkpoint-{good_step + 2}").mkdir(parents=True)
    return cut


def test_hf_trainer_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output"))
    stopped = runs.stop_by_signal_then_cloud_notice(SCRIPT, tmp_path, args, STEPS, mock_metadata, _rng)
    cut = plant_broken_checkpoints(tmp_path, stopped)
    last = runs.finish_identically(SCRIPT, tmp_path, args, reference)
    assert f"skipping {cut}: incomplete" in last.stderr
    assert "checksum does not match the manifest" in last.stderr


def test_hf_trainer_notice_during_evaluation_and_warmup_still_checkpoints(tmp_path, reference):
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output"))
    in_eval = runs.stop_during_evaluation_then_warmup(SCRIPT, tmp_path, args, [10, 20], 4, _rng)
    assert "during an evaluation" in in_eval.stderr
    last = runs.finish_identically(SCRIPT, tmp_path, args, reference)
    # The cut evaluation ran again first, from the streams it started with (else the next steps differ).
    assert "running the evaluation of step" in last.stderr and "'eval_loss'" in last.stdout


@pytest.fixture(params=["links", "copies"])
def storage_fs(request, tmp_path):
    """Where the run's storage is: beside the Trainer's folder (a local storage stores its files as hard links),
    or on another filesystem (copies: the Trainer's folder keeps its own files, the cut run's marker too)."""
    if request.param == "links":
        yield
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no other filesystem than the test's at /dev/shm")
    other = Path(tempfile.mkdtemp(prefix="spotguard-test-", dir=shm))
    (other / "ckpt").mkdir()
    (tmp_path / "ckpt").symlink_to(other / "ckpt")
    try:
        yield
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_stop_at_the_last_step_resumes_without_training_past_it(tmp_path, reference, storage_fs):
    """The Trainer checks ``max_steps`` after a step: resumed at the last one (here cut in its evaluation),
    it trained one step more (step 41, at learning rate 0) and ended elsewhere than the uninterrupted run."""
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output"))
    slow_eval = ("--eval-sleep", "0.3")  # the notice lands in the evaluation of step 40, the last step
    first = runs.stop_when(
        SCRIPT, tmp_path, (*args, *slow_eval), after_step(tmp_path / "losses.jsonl", STEPS), runs.sigterm
    )
    assert runs.assert_stopped(first, tmp_path) == STEPS
    # The cut checkpoint's files, held by links of our own: the Trainer's folder holds them as links too (a
    # local storage on its filesystem), and the final save must write new files, never these again (until
    # committed, they are the resume point).
    cut = (tmp_path / "ckpt").resolve() / f"step-{STEPS:08d}"
    held = {f: (cut.parent.parent / f"held-{f.name}", f.read_bytes()) for f in cut.iterdir()}
    for f, (link, _) in held.items():
        os.link(f, link)
    runs.finish_identically(SCRIPT, tmp_path, args, reference)
    assert all(link.read_bytes() == data for link, data in held.values())
    # The stored final checkpoint too: the cut one holds the streams its evaluation began with; the final
    # save after that evaluation is run again holds those it left, as the uninterrupted run's does (and no
    # marker of the cut, which the Trainer's folder still holds where it has copies).
    newest = max((i for i in runs.checkpoints(tmp_path) if i.complete), key=lambda i: (i.step, i.name))
    assert newest.step == STEPS and newest.manifest.reason == "final", newest
    same = compare(str(tmp_path / "ckpt"), str(reference[1].parent / "ckpt"))
    assert same.exact and same.step == STEPS, same.line()
