"""Hugging Face Trainer with a DeepSpeed config (ZeRO-2) + SpotguardCallback under torchrun on the CPU,
two nodes of one rank that share no folder: a notice on rank 1 only stops both ranks after the same
step, the checkpoint holds DeepSpeed's folder (one optimizer partition per rank) beside the Trainer's
files, each node fetches only its own rank's partition and RNG file, and the resume equals an
uninterrupted run bit for bit.

On the CPU the Trainer reports its distributed type as MULTI_CPU, but the model is a DeepSpeed engine
(the optimizer states are partitioned over the 2 ranks: ``zero_pp_rank_{0,1}_*``).
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from . import groups

pytest.importorskip("transformers")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs deepspeed: pip install 'spotguard[deepspeed]'", allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = "hf_trainer.py"
STEPS = 24
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--deepspeed", "2", "--interval", "0.2")
ARGS += ("--providers", "signal,file")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


def output_dir(node) -> tuple[str, ...]:
    return ("--output-dir", str(node / "hf-output"))


def test_hf_trainer_with_deepspeed_zero2_on_two_nodes_stops_every_rank_and_each_node_fetches_its_partition(tmp_path):
    reference = groups.reference(SCRIPT, tmp_path / "reference", ARGS, nodes=2, nproc=1, local_args=output_dir)
    job = groups.Job(SCRIPT, tmp_path / "run", ARGS, nodes=2, nproc=1, local_args=output_dir)
    at = _rng.randint(3, STEPS - 6)
    stopped, names = groups.assert_all_stopped(job, job.stop_rank_at(1, at), at)
    partitions = {name for name in names if name.endswith("_optim_states.pt") and "zero_pp_rank_" in name}
    assert len(partitions) == 2, (stopped, names)  # ZeRO-2: each rank wrote its own optimizer partition
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= names, names
    resumed = groups.finish(job, reference, quiet=False)
    # Each node fetched the shared files, its rank's RNG file and its rank's optimizer partition only.
    tag = f"global_step{stopped}"
    groups.assert_each_node_left_out_the_others(
        resumed,
        stopped,
        lambda rank: {f"rng_state_{rank}.pth", f"{tag}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"},
    )
