"""Accelerate + AcceleratorGuard under ``accelerate launch`` (DDP, gloo on CPU): a notice on rank 1 only
(in an evaluation, or at a random step) stops both ranks after the same step, the ``save_state`` folders of all ranks are committed as one
checkpoint, and the resume equals an uninterrupted 2-rank run bit for bit, on one machine and on two
machines (``--num_machines 2``) that share nothing but the checkpoint storage."""

from __future__ import annotations

import json
import random

import pytest

from . import groups

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPT = "accelerate_train.py"
STEPS = 24
# Saves every 10 steps, 16 batches per epoch on each rank: notices meet saves and an epoch end. An
# evaluation (4 batches, dropout on and noisy inputs: random draws) after each epoch's last step.
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--interval", "0.2", "--providers", "signal,file")
ARGS += ("--eval-steps", "16", "--eval-augment")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return groups.reference(SCRIPT, tmp_path_factory.mktemp("accelerate-ddp-reference"), ARGS, launcher="accelerate")


def test_accelerate_launch_stops_every_rank_for_a_notice_in_one_ranks_evaluation_and_resumes_exactly(
    tmp_path, reference
):
    """Rank 1's notice comes during the evaluation after the epoch's last step: both ranks leave it at
    the same batch, the checkpoint of step 16 holds the streams the evaluation found and the loaders as
    at their last batch, and the resumed run evaluates again, then trains on as the reference."""
    job = groups.Job(SCRIPT, tmp_path, ARGS, launcher="accelerate")
    trace = tmp_path / "trace.jsonl"

    def evaluations() -> int:  # evaluation batches of step 16, both ranks
        lines = trace.read_text().splitlines() if trace.exists() else []
        return sum(json.loads(e) == {"event": "eval_batch", "step": 16} for e in lines if e.endswith("}"))

    procs = job.stop_rank_when(1, lambda: evaluations() > 0, "--trace", str(trace), "--eval-sleep", "1")
    assert groups.assert_all_stopped(job, procs, 16)[0] == 16
    assert evaluations() < 2 * 4  # cut short
    groups.finish(job, reference)


def test_accelerate_on_two_machines_without_a_shared_folder_commits_one_checkpoint(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, nodes=2, nproc=1, launcher="accelerate")
    stopped, names = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng, quiet=False)
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= names
    # Each machine fetched the shared files and its own process's RNG and loader files, not the other's.
    groups.assert_each_node_left_out_the_others(
        job.resumed, stopped, lambda rank: {f"random_states_{rank}.pkl", f"spotguard-loaders-{rank:05d}.pt"}
    )
