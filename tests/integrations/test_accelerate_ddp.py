"""Accelerate + AcceleratorGuard under ``accelerate launch`` (DDP, gloo on CPU): a notice on rank 1 only
stops both ranks after the same step, the ``save_state`` folders of all ranks are committed as one
checkpoint, and the resume equals an uninterrupted 2-rank run bit for bit, on one machine and on two
machines (``--num_machines 2``) that share nothing but the checkpoint storage."""

from __future__ import annotations

import random

import pytest

from . import groups

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPT = "accelerate_train.py"
STEPS = 24
# Saves every 10 steps, 16 batches per epoch on each rank: notices meet saves and an epoch end.
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--interval", "0.2", "--providers", "signal,file")
_rng = random.Random()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return groups.reference(SCRIPT, tmp_path_factory.mktemp("accelerate-ddp-reference"), ARGS, launcher="accelerate")


def test_accelerate_launch_stops_every_rank_for_one_ranks_notice_and_resumes_exactly(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, launcher="accelerate")
    groups.stop_one_rank_then_finish(job, STEPS, reference, _rng)


def test_accelerate_on_two_machines_without_a_shared_folder_commits_one_checkpoint(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, nodes=2, nproc=1, launcher="accelerate")
    stopped, names = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng, quiet=False)
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= names
    # Each machine fetched the shared files and its own process's RNG and loader files, not the other's.
    groups.assert_each_node_left_out_the_others(
        job.resumed, stopped, lambda rank: {f"random_states_{rank}.pkl", f"spotguard-loaders-{rank:05d}.pt"}
    )
