"""Hugging Face Trainer + SpotguardCallback: stopped by SIGTERM, a cloud notice, during an evaluation and
during warm-up, resumed each time, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from spotguard.cli import main as spotguard_main
from spotguard.mockmeta import endpoint_env

from ..helpers import read_losses, subprocess_env
from ..test_resume import assert_same_run
from . import runs

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = "hf_trainer.py"
STEPS = 40
# Saves every 15 steps, evaluations (4 batches) every 10: a notice meets saves, evaluations and epoch ends
# (32 batches per epoch).
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "10", "--interval", "0.2")
SLOW = ("--step-sleep", "0.05")
_rng = random.Random()  # the test's own randomness


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("hf-reference"), *ARGS)


def plant_broken_checkpoints(run_dir, good_step: int) -> None:
    """What a kill mid-save leaves: newer folders without a manifest, or whose files fail their checksums."""
    good = run_dir / "ckpt" / f"step-{good_step:08d}"
    cut = run_dir / "ckpt" / f"step-{STEPS - 1:08d}"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    bad = run_dir / "ckpt" / f"step-{STEPS - 2:08d}"
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["step"] = STEPS - 2
    (bad / "manifest.json").unlink()
    (bad / "manifest.json").write_text(json.dumps(manifest))
    weights = bytearray((bad / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (bad / "model.safetensors").unlink()  # a hard link of the good one: replace, never edit
    (bad / "model.safetensors").write_bytes(bytes(weights))
    # The Trainer's own folder: a checkpoint-N cut short, the one `resume_from_checkpoint=True` would take.
    (run_dir / "hf-output" / f"checkpoint-{STEPS - 1}").mkdir(parents=True)


def test_hf_trainer_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output"))
    at = _rng.randint(2, 17)
    first = runs.stop_when(SCRIPT, tmp_path, (*args, *SLOW), runs.after_step(tmp_path, at), runs.sigterm)
    stopped = runs.assert_stopped(first, tmp_path)
    assert at <= stopped < STEPS

    server = mock_metadata("aws")
    env = subprocess_env(**endpoint_env("aws", server.url))
    at = _rng.randint(stopped + 2, STEPS - 5)
    second = runs.stop_when(
        SCRIPT, tmp_path, (*args, *SLOW, "--providers", "signal,aws"), runs.after_step(tmp_path, at),
        lambda proc: spotguard_main(["simulate-preemption", "--cloud", "aws", "--endpoint", server.url]), env=env)
    assert "notice from aws" in second.stdout, second.stdout
    stopped = runs.assert_stopped(second, tmp_path)
    assert at <= stopped < STEPS
    assert "before the deadline" in second.stderr  # the AWS notice carries one: the commit reports its margin

    plant_broken_checkpoints(tmp_path, stopped)
    last = runs.run(SCRIPT, tmp_path, *args, "--final", str(tmp_path / "final.pt"))
    assert last.returncode == 0, last.stderr[-4000:]
    assert f"skipping {tmp_path / 'ckpt' / f'step-{STEPS - 1:08d}'}: incomplete" in last.stderr
    assert "SHA-256 does not match" in last.stderr
    assert_same_run(tmp_path / "losses.jsonl", tmp_path / "final.pt", reference)


def test_hf_trainer_notice_during_evaluation_and_warmup_still_checkpoints(tmp_path, reference):
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output"))
    at = _rng.choice([10, 20])
    in_eval = lambda: any(e["event"] == "eval_batch" and e["step"] == at for e in runs.events(tmp_path))  # noqa: E731
    first = runs.stop_when(SCRIPT, tmp_path, (*args, *SLOW, "--eval-sleep", "2"), in_eval, runs.sigterm)
    assert runs.assert_stopped(first, tmp_path) == at
    assert "during an evaluation" in first.stderr
    batches = [e for e in runs.events(tmp_path) if e["event"] == "eval_batch" and e["step"] == at]
    assert len(batches) < 4  # cut short: the checkpoint did not wait for the whole evaluation

    began = lambda: sum(e["event"] == "train_begin" for e in runs.events(tmp_path)) == 2  # noqa: E731
    second = runs.stop_when(SCRIPT, tmp_path, (*args, *SLOW, "--warmup-sleep", "1"), began, runs.sigterm)
    assert runs.assert_stopped(second, tmp_path) == at  # nothing trained since the resume point
    assert "already checkpointed" in second.stderr
    assert max(i.step for i in runs.checkpoints(tmp_path)) == at

    last = runs.run(SCRIPT, tmp_path, *args, "--final", str(tmp_path / "final.pt"))
    assert last.returncode == 0, last.stderr[-4000:]
    assert_same_run(tmp_path / "losses.jsonl", tmp_path / "final.pt", reference)
    assert read_losses(tmp_path / "losses.jsonl")[-1][0] == STEPS
