"""Worker for tests/checkpoint/test_sharded.py (plain processes, gloo): what each rank stages under DDP.

Two ranks train a DDP model with AdamW; step 2 is a periodic, background sharded save. Each rank
reports the bytes it staged (copied to host memory) for it beside the bytes of its whole DCP state
(replicated: the same on both ranks), the staging buffers that save allocated (none: reserved after
step 1) and the committed save's own work as the stats saw it; then a fresh model and optimizer resume the checkpoint, and each rank reports whether its
parameters and optimizer state are bit-exact copies of the saved ones.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spotguard import Guard
from spotguard.checkpoint.collective import dcp_state
from spotguard.checkpoint.state.budget import tensor_bytes
from spotguard.storage import LocalStorage
from tests.workers.results import emit


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer state tensor, cloned, in a fixed order."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.detach().clone() for _, v in sorted(opt.state[p].items())]
    return out


def main() -> int:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model, opt = build()
    guard = Guard(LocalStorage(root), providers=None, every_steps=2, async_sharded=True).track(
        model=model, optimizer=opt
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    with guard:
        for step in (1, 2):
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                saved = tensors(model, opt)
                whole = tensor_bytes(dcp_state({"model": model, "optimizer": opt}))
            guard.step(step)
        staged, allocations = guard.saves.engine.staged_bytes, guard.saves.engine._staging.allocations
        guard.saves.wait_pending()
    stats = guard.stats()
    emit(
        out,
        staged=staged,
        whole=whole,
        allocations=allocations,
        alloc_s=stats.alloc_s,
        work_Bps=stats.work_Bps,
        checkpoints=stats.checkpoints,
    )

    model2, opt2 = build()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    resumed = Guard(LocalStorage(root), providers=None).track(model=model2, optimizer=opt2).resume()
    got = tensors(model2, opt2)
    exact = len(got) == len(saved) and all(torch.equal(a, b) for a, b in zip(got, saved, strict=True))
    emit(out, resumed=resumed, exact=exact)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
