"""Lightning + SpotguardCallback under torchrun (``strategy="ddp"``, gloo on CPU): a notice on rank 1 only
stops both ranks after the same step, the checkpoint holds Lightning's ``.ckpt`` (rank 0's) and every
rank's RNG streams (Lightning seeds dropout per rank and saves none), and the resume equals an
uninterrupted 2-rank run bit for bit, on one node and on two nodes that share nothing but the storage.

The example shuffles with torchdata's ``StatefulDistributedSampler`` and ``use_distributed_sampler=False``:
Lightning's own ``DistributedSamplerWrapper`` keeps no shuffle state, so its resumes are not exact.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from spotguard.checkpoint import scan
from spotguard.ops.rehearsal.compare import compare
from spotguard.storage import open_storage

from ..helpers import last_step, read_jsonl, stop_when
from . import groups

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = "lightning_train.py"
STEPS = 24
# Saves every 10 steps, 16 batches per epoch on each rank: notices meet saves and an epoch end.
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--interval", "0.2", "--providers", "signal,file")
# Validations (4 batches per rank) every 10 steps.
VALIDATING = (*ARGS, "--eval-steps", "10")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return groups.reference(SCRIPT, tmp_path_factory.mktemp("lightning-ddp-reference"), ARGS)


def test_lightning_ddp_stops_every_rank_for_one_ranks_notice_and_resumes_exactly(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS)
    _, names = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng)
    assert {"lightning.ckpt", "rng-rank-00000.pt", "rng-rank-00001.pt"} <= names
    assert_same_final_checkpoint(tmp_path, reference)


def test_lightning_ddp_on_two_nodes_without_a_shared_folder_resumes_exactly(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, nodes=2, nproc=1)
    stopped, _ = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng, quiet=False)
    # Each node fetched (once Lightning's process group was up) the .ckpt and its own rank's RNG streams only.
    groups.assert_each_node_left_out_the_others(job.resumed, stopped, lambda rank: {f"rng-rank-{rank:05d}.pt"})


def test_lightning_ddp_resumes_a_checkpoint_of_an_epochs_last_batch_exactly(tmp_path, reference):
    # Saves every 8 steps: step 16 is the last batch of epoch 0 (16 per rank). A crash after it resumes
    # from 16: Lightning alone counts epoch 0 done twice and skips epoch 1 (the checkpoint's spent iterator).
    args = tuple("8" if a == "10" else a for a in ARGS)
    job = groups.Job(SCRIPT, tmp_path, args)
    ((cmd, env),) = job.commands(*groups.SLOW)
    crashed = stop_when(
        cmd, lambda: (last_step(job.losses) or 0) >= 18, lambda p: os.killpg(p.pid, signal.SIGKILL), env=env
    )
    assert crashed.returncode == -signal.SIGKILL
    complete = [i.step for i in scan(open_storage(str(tmp_path / "ckpt"))) if i.status == "complete"]
    assert max(complete) == 16, complete
    groups.finish(job, reference)
    assert_same_final_checkpoint(tmp_path, reference)


@pytest.fixture(scope="module")
def reference_validating(tmp_path_factory):
    return groups.reference(SCRIPT, tmp_path_factory.mktemp("lightning-ddp-reference-validating"), VALIDATING)


def test_lightning_ddp_stop_starts_no_validation_the_uninterrupted_run_did_not_run(tmp_path, reference_validating):
    # Lightning validates when a callback sets should_stop (as for early stopping): after a stop between two
    # validations, one validation batch ran on the deadline's clock before the notice cut it.
    trace = tmp_path / "trace.jsonl"
    job = groups.Job(SCRIPT, tmp_path, (*VALIDATING, "--trace", str(trace)))
    at = _rng.randint(11, 15)
    stopped, _ = groups.assert_all_stopped(job, job.stop_rank_at(1, at), at)
    validated = sorted({e["step"] for e in read_jsonl(trace) if e["event"] == "eval_batch"})
    # The validations before the stop step, none at it (one due there is the resumed run's first work).
    assert validated == list(range(10, stopped, 10)), (validated, stopped)
    groups.finish(job, reference_validating)
    assert_same_final_checkpoint(tmp_path, reference_validating)


def assert_same_final_checkpoint(run_dir, reference) -> None:
    """The stored final checkpoints are equal, Lightning's loop counters (its epoch) included."""
    same = compare(str(run_dir / "ckpt"), str(reference[1].parent / "ckpt"))
    assert same.exact and same.step == STEPS and same.compared > 100, same.line()
