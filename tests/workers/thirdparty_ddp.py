"""A user's torchrun script, not ours: a small classifier trained with DDP, written from the README and
docs/distributed.md alone, the way people write their training scripts.

What makes it hard to resume exactly: a ``DistributedSampler`` reshuffled with ``set_epoch`` and a
torchdata ``StatefulDataLoader`` whose last batch per epoch is short; gradient accumulation under
``ddp.no_sync()`` counted with ``enumerate`` (which restarts at 0 after a mid-epoch resume), whose
leftover micro-batches at the end of an epoch join the next epoch's first optimizer step; a
per-step OneCycleLR; gradient clipping; dropout; an evaluation every few optimizer steps on rank 0
alone (the others wait at a barrier) that samples its batch from a generator of its own; the
epoch counter in ``guard.extra``. ``--destroy after`` tears the process group down after the
``with guard:`` block (docs/distributed.md), ``--destroy inside`` inside it (a common habit).
Used by tests/guard/test_thirdparty_ddp.py:

    torchrun --nproc-per-node 2 tests/workers/thirdparty_ddp.py --storage ckpt --out out/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


class GeneratorState:
    """track() wants state_dict()/load_state_dict(); a torch.Generator has get_state()/set_state()."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["state"])


def make_data(n: int, teacher: torch.Tensor, gen: torch.Generator) -> TensorDataset:
    """Points labelled by a noisy linear teacher: learnable, not trivially."""
    x = torch.randn(n, teacher.shape[0], generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(n, teacher.shape[1], generator=gen)).argmax(1)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.2)
        )
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def evaluate(model: nn.Module, data: TensorDataset, gen: torch.Generator, n: int = 32) -> float:
    idx = torch.randperm(len(data), generator=gen)[:n]  # a fresh random eval batch each time
    x, y = data.tensors[0][idx], data.tensors[1][idx]
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(x), y).item()
    model.train()
    return loss


def append(path: Path, **record: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    torch.manual_seed(args.seed)

    data_gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(16, 4, generator=data_gen)
    train_set, eval_set = make_data(200, teacher, data_gen), make_data(128, teacher, data_gen)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(train_set, batch_size=args.batch_size, sampler=sampler)  # last batch short

    model = Net()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.3
    )
    eval_gen = torch.Generator().manual_seed(args.seed + 1)

    guard = spotguard.Guard(args.storage, every_steps=args.every_steps, keep=3, providers="auto")
    guard.track(model=ddp, optimizer=opt, scheduler=sched, loader=loader, eval_rng=GeneratorState(eval_gen))
    step = guard.resume()
    epoch = guard.extra.get("epoch", 0)
    print(f"[rank {rank}] starting at step {step}, epoch {epoch}", flush=True)

    running = 0.0
    with guard:
        while epoch < args.epochs:
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                sync = (i + 1) % args.accum == 0
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = F.cross_entropy(ddp(x), y) / args.accum
                    loss.backward()
                running += loss.item()
                if not sync:
                    continue
                nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                append(out / f"losses-{rank}.jsonl", step=step, loss=running.hex())
                running = 0.0
                if step % args.eval_every == 0:
                    if rank == 0:
                        append(out / "evals.jsonl", step=step, loss=evaluate(model, eval_set, eval_gen).hex())
                    dist.barrier()
                time.sleep(args.step_sleep)
                if guard.step(step):
                    print(f"[rank {rank}] stopped at step {step}", flush=True)
                    if args.destroy == "inside":
                        dist.destroy_process_group()
                    sys.exit(spotguard.EXIT_PREEMPTED)
            epoch += 1
            guard.extra["epoch"] = epoch
        final = {"model": model.state_dict(), "optimizer": opt.state_dict(), "lr": sched.get_last_lr()}
        torch.save(final, out / f"final-{rank}.pt")
        print(f"[rank {rank}] done at step {step}", flush=True)
        if args.destroy == "inside":
            dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--out", required=True, help="folder for losses-<rank>.jsonl, evals.jsonl, final-<rank>.pt")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--every-steps", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--destroy", choices=["after", "inside"], default="after")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s [rank {os.environ.get('RANK')}] %(name)s: %(message)s"
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    if args.destroy == "inside":
        return train(args)
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
