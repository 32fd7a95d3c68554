"""Each trainer's rule for its per-rank files (spotguard/integrations/_rankfiles.py) and DeepSpeed's
doubts (``deepspeed.fetch_rule``): which rank alone reads a file; every other file is shared.

The names are those each trainer writes (transformers 5.24 ``_save_rng_state``, accelerate 1.15
``save_accelerator_state``, DeepSpeed 0.19 ``save_checkpoint``, spotguard's own files); the two-node
tests (tests/integrations/test_*_ddp.py, test_deepspeed.py) check them on real checkpoints.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spotguard.checkpoint.folders import pernode
from spotguard.integrations import _accelerate_loaders, _rankfiles, deepspeed


@pytest.mark.parametrize(
    ("rule", "own", "shared"),
    [
        (
            _rankfiles.hf,
            {"rng_state_0.pth": 0, "rng_state_1.pth": 1, "rng_state_15.pth": 15},
            # rng_state.pth: a single process's; DeepSpeed and FSDP shards under the Trainer: fetched whole
            ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin"]
            + ["rng_state.pth", "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt", "sub/rng_state_1.pth"],
        ),
        (
            _rankfiles.accelerate,
            {"random_states_0.pkl": 0, "random_states_3.pkl": 3, _accelerate_loaders.file_name(2): 2},
            ["model.safetensors", "optimizer.bin", "scheduler.bin", "dl_state_dict.bin", "custom_checkpoint_0.pkl"]
            + ["pytorch_model_fsdp_0/__1_0.distcp", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        ),
        (
            _rankfiles.hf_deepspeed,  # a Trainer with a DeepSpeed config: its ZeRO partitions too
            {
                "rng_state_1.pth": 1,
                "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
                "global_step10/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": 0,
                "global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt": 1,
            },
            ["model.safetensors", "latest", "trainer_state.json", "global_step10/mp_rank_00_model_states.pt"]
            + ["zero_to_fp32.py", "zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        ),
        (_rankfiles.lightning, {"rng-rank-00000.pt": 0, "rng-rank-00001.pt": 1}, ["lightning.ckpt", "rng-rank-x.pt"]),
        (
            _rankfiles.deepspeed,
            {
                f"step9/{deepspeed.rank_file(1)}": 1,
                "step9/zero_pp_rank_0_mp_rank_00_optim_states.pt": 0,
                "step9/bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt": 12,
                "step9/zero_pp_rank_1_mp_rank_00_model_states.pt": 1,  # ZeRO-3: each rank's parameters
            },
            ["latest", "zero_to_fp32.py", "step9/mp_rank_00_model_states.pt", "step9/spotguard-rank1.pt.tmp"],
        ),
    ],
)
def test_each_trainers_rule_claims_its_per_rank_files_and_nothing_else(rule, own, shared):
    assert {name: rule(name) for name in own} == own
    assert [rule(name) for name in shared] == [None] * len(shared)


def test_a_node_of_a_two_rank_hf_job_fetches_the_shared_files_and_its_ranks_rng_state():
    names = ["model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"]
    node1 = pernode.needed(names, _rankfiles.hf, {1}, world=2)
    assert node1 == ["model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_1.pth"]


def engine(**over):
    """The attributes of a DeepSpeedEngine that ``fetch_rule`` reads (DeepSpeed 0.19's names)."""
    attrs = {
        "zero_elastic_checkpoint": lambda: False,
        "load_universal_checkpoint": lambda: False,
        "has_moe_layers": False,
        "mp_world_size": 1,
        "dp_world_size": 4,
        "seq_dp_world_size": 4,
    }
    attrs.update(over)
    return SimpleNamespace(**attrs)


def test_deepspeed_trusts_its_rule_for_plain_data_parallelism():
    rule = deepspeed.fetch_rule(engine(), world=4)
    assert rule.unsure == "" and rule.rank_of("step1/zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"zero_elastic_checkpoint": lambda: True}, "elastic checkpoint"),  # every rank reads every partition
        ({"load_universal_checkpoint": lambda: True}, "universal"),
        ({"has_moe_layers": True}, "expert"),
        ({"mp_world_size": 2, "dp_world_size": 2, "seq_dp_world_size": 2}, "data-parallel rank"),
        ({"dp_world_size": 2, "seq_dp_world_size": 2}, "data-parallel rank"),  # pipeline stages
        ({"dp_world_size": 2}, "data-parallel rank"),  # sequence parallelism
    ],
)
def test_deepspeed_is_unsure_where_zero_files_are_not_one_per_global_rank(over, why):
    assert why in deepspeed.fetch_rule(engine(**over), world=4).unsure


def test_an_hf_deepspeed_config_trusts_the_rule_for_plain_data_parallelism():
    config = {"zero_optimization": {"stage": 2, "elastic_checkpoint": "auto"}, "train_batch_size": "auto"}
    assert _rankfiles.config_doubt(config, torch.nn.Linear(2, 2)) == ""


class MoE(torch.nn.Module):
    """Stands for a layer of ``deepspeed.moe.layer`` (only its module's name is looked at)."""


MoE.__module__ = "deepspeed.moe.layer"


@pytest.mark.parametrize(
    ("config", "model", "why"),
    [
        ({"zero_optimization": {"elastic_checkpoint": True}}, None, "elastic checkpoint"),
        ({"checkpoint": {"load_universal": True}}, None, "universal"),
        ({}, torch.nn.Sequential(torch.nn.Linear(2, 2), MoE()), "expert"),
        ({"tensor_parallel": {"autotp_size": 2}}, None, "data-parallel rank"),
        ({"sequence_parallel_size": 2}, None, "data-parallel rank"),
    ],
)
def test_an_hf_deepspeed_config_makes_the_rule_unsure_where_zero_files_are_not_per_rank(config, model, why):
    assert why in _rankfiles.config_doubt(config, model)
