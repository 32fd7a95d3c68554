"""Hugging Face Trainer + SpotguardCallback under torchrun (DDP, gloo): a notice on rank 1 only stops both
ranks after the same step, the folders of all ranks are committed as one checkpoint, and the resume
equals an uninterrupted 2-rank run bit for bit, on one node and on two nodes that share no folder."""

from __future__ import annotations

import random

import pytest

from spotguard.ops.rehearsal.compare import compare

from . import groups

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCRIPT = "hf_trainer.py"
STEPS = 24
# Saves every 10 steps, 16 batches per epoch (2 ranks x 8): notices meet saves and an epoch end.
# Evaluations every 6 steps draw random numbers (test-time augmentation).
ARGS = (
    *("--steps", str(STEPS), "--every-steps", "10", "--eval-steps", "6", "--eval-augment"),
    *("--interval", "0.2", "--providers", "signal,file"),
)
_rng = random.Random()


def output_dir(node) -> tuple[str, ...]:
    return ("--output-dir", str(node / "hf-output"))  # the Trainer's own folder: local to each node


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return groups.reference(SCRIPT, tmp_path_factory.mktemp("hf-ddp-reference"), ARGS, local_args=output_dir)


@pytest.fixture(scope="module")
def reference_two_nodes(tmp_path_factory):
    # Its own reference: the logged loss (a gather over ranks) differs in the last bits between
    # 2 ranks on one node and on two (gloo's transport), though the weights do not.
    where = tmp_path_factory.mktemp("hf-ddp-reference-nodes")
    return groups.reference(SCRIPT, where, ARGS, nodes=2, nproc=1, local_args=output_dir)


def test_hf_trainer_under_torchrun_stops_every_rank_for_one_ranks_notice_and_resumes_exactly(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, local_args=output_dir)
    groups.stop_one_rank_then_finish(job, STEPS, reference, _rng)


@pytest.mark.parametrize("last", [False, True], ids=["mid-run", "last-step"])
def test_hf_trainer_under_torchrun_cut_in_an_evaluation_by_one_rank_runs_it_again_exactly(tmp_path, reference, last):
    """Rank 1's notice comes during an evaluation: every rank leaves it at the same batch (the vote runs
    per evaluation batch), the checkpoint holds the streams it started with, and the resume runs it
    again first: the evaluation's random draws leave the streams where the uninterrupted run had them.
    At the last step the resume then has no step left to train: it commits the state after the evaluation
    run again as the final checkpoint, which equals the uninterrupted run's, every rank's streams included."""
    job = groups.Job(SCRIPT, tmp_path, ARGS, local_args=output_dir)
    at, trace = STEPS if last else _rng.choice([6, 12, 18]), tmp_path / "trace.jsonl"

    def in_eval() -> bool:
        lines = trace.read_text().splitlines() if trace.exists() else []
        return any('"eval_batch"' in line and f'"step": {at}}}' in line for line in lines)

    procs = job.stop_rank_when(1, in_eval, "--trace", str(trace), "--eval-sleep", "1")
    stopped, _ = groups.assert_all_stopped(job, procs, at)
    assert stopped == at and "during an evaluation" in procs[0].stderr
    groups.finish(job, reference)
    same = compare(str(tmp_path / "ckpt"), str(reference[1].parent / "ckpt"))
    assert same.exact and same.step == STEPS, same.line()


def test_hf_trainer_on_two_nodes_without_a_shared_folder_commits_one_checkpoint(tmp_path, reference_two_nodes):
    job = groups.Job(SCRIPT, tmp_path, ARGS, nodes=2, nproc=1, local_args=output_dir)
    at = _rng.randint(3, STEPS - 6)
    stopped, names = groups.assert_all_stopped(job, job.stop_rank_at(1, at), at)
    # Each node's Trainer folder holds what its rank wrote; the checkpoint holds both. c10d numbers
    # the nodes as they arrive: find rank 1's node by its file.
    a, b = (tmp_path / f"node{n}" / "hf-output" / f"checkpoint-{stopped}" for n in (0, 1))
    rank1, rank0 = (a, b) if (a / "rng_state_1.pth").exists() else (b, a)
    assert (rank1 / "rng_state_1.pth").exists() and not (rank1 / "model.safetensors").exists()
    assert (rank0 / "model.safetensors").exists() and not (rank0 / "rng_state_1.pth").exists()
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= names
    resumed = groups.finish(job, reference_two_nodes, quiet=False)
    # Each node fetched the shared files and its own rank's RNG file, not the other rank's.
    groups.assert_each_node_left_out_the_others(resumed, stopped, lambda rank: {f"rng_state_{rank}.pth"})
