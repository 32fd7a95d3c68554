"""Worker for tests/test_teardown.py: a 2-rank training script as a user writes it from the README.

gloo, DDP (or FSDP2), AdamW, a StatefulDataLoader; a Guard tracks them, resumes, and the loop runs
inside ``with guard:``. Run by torchrun or as plain processes (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set: rank 0 hosts the store). ``--order`` is the teardown the program does:

  after   ``dist.destroy_process_group()`` after the block, as PyTorch recommends
  inside  ``dist.destroy_process_group()`` inside the block, before it ends
  none    the process group is never destroyed
  fsdp2   an FSDP2 model, destroyed after the block; nothing deleted first

``--sigterm-at N``: rank 1 sends itself SIGTERM after step N (every rank stops, emergency save).
Rank 0 prints ``resumed=R last=L stopped=S``; each rank prints the gloo threads it had before the
Guard and after the block (the Guard must leave none behind). Exits 0, stopped or not.
"""

from __future__ import annotations

import argparse
import os
import signal
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard import Guard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def gloo_threads() -> int:
    """gloo's native threads in this process (two workers per group, socket loops)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            count += "gloo" in open(f"/proc/self/task/{tid}/comm").read()
        except OSError:
            pass  # the thread ended meanwhile
    return count


def build(order: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if order != "fsdp2":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("--steps", type=int, required=True, help="train up to this step")
    p.add_argument("--order", choices=["after", "inside", "none", "fsdp2"], default="after")
    p.add_argument("--sigterm-at", type=int)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(512, 8, generator=torch.Generator().manual_seed(1)), torch.randn(512, 1))
    loader = StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))
    model = build(args.order)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dist.barrier()  # the default group's threads exist from here on
    before = gloo_threads()

    guard = Guard(args.storage, every_steps=2, providers="signal")
    guard.track(model=model, optimizer=opt, loader=loader)
    step = resumed = guard.resume()
    stopped = None
    with guard:
        for x, y in loader:
            if step >= args.steps:
                break
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 1 and step == args.sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if guard.step(step):
                stopped = step
                break
        if args.order == "inside":
            dist.destroy_process_group()
    after = gloo_threads()
    if args.order in ("after", "fsdp2"):
        dist.destroy_process_group()
    if rank == 0:
        print(f"resumed={resumed} last={step} stopped={stopped}", flush=True)
    print(f"rank {rank} gloo threads before the guard: {before}, after the block: {after}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
