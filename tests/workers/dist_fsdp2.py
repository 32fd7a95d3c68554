"""Worker for tests/guard/test_distributed.py (run by torchrun): an FSDP2 model saved by spotguard.

Trains three steps, saves a sharded checkpoint of step 3, and (rank 0) writes the full, gathered
model and optimizer state next to it for the test to compare with.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from spotguard import Guard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optimizer": get_optimizer_state_dict(model, opt, options=FULL),
    }


def main() -> int:
    root, full_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model, opt = build()
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    Guard(root, providers=None).track(model=model, optimizer=opt).save(3)
    full = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(full, full_path)
    dist.destroy_process_group()  # the Guard, never closed here, destroys its own groups at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
