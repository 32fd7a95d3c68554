"""Accelerate + AcceleratorGuard under ``accelerate launch --use_fsdp`` (FSDP2, sharded state dict): a
notice on rank 1 only stops both ranks after the same step, every rank's ``save_state`` shards are
committed as one checkpoint, and the resume equals an uninterrupted FSDP run bit for bit.

Accelerate 1.15 runs FSDP only on an accelerator: on CPU, ``AcceleratorState`` keeps
``DistributedType.MULTI_CPU`` and drops the FSDP plugin without a word (``accelerate/state.py``: the
branch that sets ``DistributedType.FSDP`` lists only the accelerator types), so the job trains with
DDP over gloo. The test skips without 2+ CUDA GPUs, and where it has them, skips unless a probe launch
reports FSDP; it runs where FSDP does (``--cuda``).
"""

from __future__ import annotations

import random

import pytest
import torch

from ..helpers import free_port, run, subprocess_env
from . import groups

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # `make gpu-check` runs it too

SCRIPT = "accelerate_train.py"
STEPS = 24
GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--interval", "0.2", "--providers", "signal,file") + (
    ("--cuda",) if GPUS else ()
)
# SHARDED_STATE_DICT: each rank writes its own shards (no gather onto rank 0) and reads them back as they were.
FSDP = ("--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "SHARDED_STATE_DICT")
REFUSED = (
    "accelerate launch --use_fsdp trained without FSDP here: Accelerate runs FSDP only on an accelerator "
    "(on CPU AcceleratorState keeps DistributedType.MULTI_CPU and drops the FSDP plugin, accelerate/state.py)"
)
_rng = random.Random()


PROBE = """
import sys
from accelerate import Accelerator
accelerator = Accelerator(cpu=sys.argv[1] == "cpu")  # as the example makes it
if accelerator.is_main_process:
    print("distributed type:", accelerator.distributed_type.value, flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted FSDP run, once Accelerate was seen to run FSDP at all (skip otherwise)."""
    if not GPUS:  # known without a launch (which costs ~20 s)
        pytest.skip(f"{REFUSED}; it needs 2+ CUDA GPUs")
    run_dir = tmp_path_factory.mktemp("accelerate-fsdp-reference")
    probe = run_dir / "probe.py"
    probe.write_text(PROBE)
    cmd = [*groups.accelerate_args(1, 2, free_port(), 0, *FSDP), str(probe), "cuda" if GPUS else "cpu"]
    proc = run(cmd, env=subprocess_env(), cwd=run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if "distributed type: FSDP" not in proc.stdout:
        pytest.skip(f"{REFUSED}; the probe said {proc.stdout.strip()!r}")
    return groups.reference(SCRIPT, run_dir, ARGS, launcher="accelerate", launcher_args=FSDP)


@pytest.mark.timeout(300)
def test_accelerate_fsdp_stops_every_rank_for_one_ranks_notice_and_resumes_exactly(tmp_path, reference):
    job = groups.Job(SCRIPT, tmp_path, ARGS, launcher="accelerate", launcher_args=FSDP)
    _, names = groups.stop_one_rank_then_finish(job, STEPS, reference, _rng)
    assert any(n.startswith("pytorch_model_fsdp") for n in names), names
