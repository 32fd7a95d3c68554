"""Hugging Face Trainer with a DeepSpeed config (ZeRO-2) + SpotguardCallback under torchrun on the CPU:
a notice on rank 1 only stops both ranks after the same step, the checkpoint holds DeepSpeed's folder
(one optimizer partition per rank) beside the Trainer's files, and the resume equals an uninterrupted
run bit for bit.

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


def output_dir(node) -> tuple[str, ...]:
    return ("--output-dir", str(node / "hf-output"))


def test_hf_trainer_with_deepspeed_zero2_stops_every_rank_and_resumes_exactly(tmp_path):
    reference = groups.reference(SCRIPT, tmp_path / "reference", ARGS, local_args=output_dir)
    job = groups.Job(SCRIPT, tmp_path / "run", ARGS, local_args=output_dir)
    stop, names = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng)
    partitions = {name for name in names if name.endswith("_optim_states.pt") and "zero_pp_rank_" in name}
    assert len(partitions) == 2, (stop, names)  # ZeRO-2: each rank wrote its own optimizer partition
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= names, names
