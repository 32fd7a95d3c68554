"""Worker for tests/storage/test_cloud_resume.py (run by torchrun, 2 ranks): sharded checkpoints in the cloud.

``dist_cloud_roundtrip.py OUT URL...``: for each URL (s3://, gs://, az://; one launch for all of them),
a DDP model with dropout and AdamW train 3 steps, step 3 is saved to the URL, then fresh objects, seeded
differently, resume it from there. Each rank writes its model, optimizer and next random numbers right
after the save and right after the resume to ``OUT/{saved,resumed}-<i>-<rank>.pt`` (i: the URL's index).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

from spotguard import Guard


def build(url: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Guard]:
    torch.manual_seed(seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, Guard(url, providers=None).track(model=model, optimizer=opt)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt),
        "rand": torch.rand(3),
    }  # what the next step's dropout would draw


def main() -> int:
    out, urls = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i, url in enumerate(urls):
        model, opt, guard = build(url, seed=rank)  # DDP broadcasts rank 0's weights; dropout differs per rank
        for _ in range(3):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        guard.save(3)
        torch.save(snapshot(model, opt), out / f"saved-{i}-{rank}.pt")

        model, opt, guard = build(url, seed=100 + rank)
        assert guard.resume() == 3
        torch.save(snapshot(model, opt), out / f"resumed-{i}-{rank}.pt")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
