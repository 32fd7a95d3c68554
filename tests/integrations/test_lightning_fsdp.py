"""Lightning + SpotguardCallback with FSDP under torchrun (gloo on CPU): a notice on rank 1 only stops both
ranks after the same step, the checkpoint holds Lightning's sharded FSDP checkpoint (a DCP folder with one
shard per rank and its ``.metadata``) and every rank's RNG streams, and the resume equals an uninterrupted
FSDP run bit for bit.

Lightning 2.6 refuses ``strategy="fsdp"`` without a GPU ("requires a GPU accelerator", a check on the
strategy's exact type) and hands torch's FSDP no device on the CPU ("FSDP needs a non-CPU accelerator
device"); torch's FSDP itself runs on the CPU when told its device. The example's ``CPUFSDPStrategy``
does only that, so this test runs the same save and resume path as a GPU job (``state_dict_type="sharded"``:
the "full" type crashes in torch's CPU state-dict gather, with ``offload_to_cpu`` on a CPU tensor).
"""

from __future__ import annotations

import random

import pytest

from . import groups

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = "lightning_train.py"
STEPS = 24
ARGS = ("--steps", str(STEPS), "--every-steps", "10", "--interval", "0.2", "--providers", "signal,file")
ARGS += ("--strategy", "fsdp")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


def test_lightning_fsdp_stops_every_rank_for_one_ranks_notice_and_resumes_exactly(tmp_path):
    reference = groups.reference(SCRIPT, tmp_path / "reference", ARGS)
    stop, names = groups.stop_one_rank_then_finish(groups.Job(SCRIPT, tmp_path / "run", ARGS), STEPS, reference, _rng)
    shards = {f"lightning.ckpt/__{rank}_0.distcp" for rank in (0, 1)}  # one per rank, written by each
    assert shards | {"lightning.ckpt/.metadata", "rng-rank-00000.pt", "rng-rank-00001.pt"} <= names, (stop, names)
