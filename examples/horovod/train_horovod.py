"""Horovod on spot machines: Horovod averages the gradients, a small gloo group carries spotguard.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod/train_horovod.py --storage ckpt/hvd
    SPOTGUARD_NOTICE_FILE='/tmp/notice-{rank}' horovodrun ...   # touch /tmp/notice-1: every rank stops

``spotguard.Guard`` agrees on the stop step and writes its sharded checkpoint through
torch.distributed, which Horovod does not start. So each rank also joins a gloo process group built
from Horovod's rank and size (rank 0's address and a free port, broadcast by Horovod): Horovod's
collectives keep the gradients, spotguard's one small all-reduce per step and its saves use the
gloo group. The loop is then the ordinary ``Guard`` loop: a notice seen by any rank stops every
rank after the same step with one committed checkpoint, and the next ``horovodrun`` resumes exactly.

Horovod 0.28.1 (its last release) builds against torch 2.1+ only with its C++ standard raised to 17:
see docs/distributed.md ("Horovod").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard


def join_process_group() -> None:
    """A gloo group with Horovod's ranks, for spotguard's stop agreement and sharded checkpoints."""
    os.environ.setdefault("LOCAL_RANK", str(hvd.local_rank()))  # cloud metadata: one poller per node
    address = None
    if hvd.rank() == 0:
        with socket.socket() as s:  # a free port on rank 0's host for the TCPStore
            s.bind(("", 0))
            address = (socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME", "localhost")), s.getsockname()[1])
    host, port = hvd.broadcast_object(address, root_rank=0, name="spotguard-store")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=hvd.rank(), world_size=hvd.size())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", required=True, help="checkpoint URL (path, s3://, gs://): every rank must reach it")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every-steps", type=int, default=100)
    p.add_argument("--interval", type=float, default=1.0, help="notice polling interval (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--losses", help="per-rank JSON lines {step, loss}; '{rank}' in the path is filled in")
    p.add_argument("--final", help="rank 0 saves the model and optimizer state here at the end (torch.save)")
    args = p.parse_args(argv)

    hvd.init()
    join_process_group()
    rank, world = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed + rank)  # each rank its own dropout stream; rank 0's weights are broadcast
    random.seed(args.seed + rank)  # every stream the Guard saves is seeded: two runs' checkpoints are equal
    np.random.seed(args.seed + rank)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # Horovod 0.28's zero_grad() takes no set_to_none, which torch.distributed.checkpoint passes when it
    # loads into an optimizer that has no state yet (resume): accept it (Horovod always sets None).
    hvd_zero_grad = opt.zero_grad
    opt.zero_grad = lambda set_to_none=True: hvd_zero_grad()  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(args.seed)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(data, batch_size=64, sampler=sampler, drop_last=True)

    guard = spotguard.Guard(args.storage, every_steps=args.every_steps or None, interval=args.interval)
    guard.track(model=model, optimizer=opt, loader=loader)
    step = guard.resume()  # every rank loads the same checkpoint: no broadcast needed after it
    epoch = int(guard.extra.get("epoch", 0))
    log = open(args.losses.format(rank=rank), "a") if args.losses else None
    stopped = False
    with guard:
        while step < args.steps and not stopped:
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()  # Horovod's all-reduce of the gradients
                step += 1
                if log:
                    log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                    log.flush()
                time.sleep(args.step_sleep)
                if guard.step(step):  # spotguard's agreement, on the gloo group
                    stopped = True
                    break
                if step >= args.steps:
                    break
            else:
                epoch += 1
                guard.extra["epoch"] = epoch
    if args.final and rank == 0 and not stopped:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, args.final)
    dist.destroy_process_group()
    if stopped:
        print(f"[train_horovod] rank {rank}: stopped at step {step}, checkpoint committed", flush=True)
        return spotguard.EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
