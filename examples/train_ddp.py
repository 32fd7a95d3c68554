"""Train the character transformer of train.py with DistributedDataParallel under spotguard.

A notice on any rank (a signal to one process, a per-rank notice file, a node's cloud metadata)
stops every rank after the same step, with one sharded checkpoint (torch.distributed.checkpoint);
run the same command again to resume exactly. gloo on CPU, NCCL on GPUs:

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/train_ddp.py --storage ckpt/ddp
    SPOTGUARD_NOTICE_FILE='/tmp/notice-{rank}' torchrun ...   # touch /tmp/notice-1: all ranks stop
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import CharTransformer, CharWindows, make_text  # noqa: E402

import spotguard  # noqa: E402

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", default="checkpoints/example-ddp", help="checkpoint URL (path, s3://, gs://)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every-steps", type=int, default=50, help="periodic checkpoint interval (0: off)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument(
        "--deadline-policy",
        choices=("stop", "use-window"),
        help="after the emergency checkpoint: stop, or train on in the notice window and checkpoint again "
        "before the deadline (default: $SPOTGUARD_DEADLINE_POLICY, else stop)",
    )
    p.add_argument("--sync-every", type=int, default=1, help="steps between stop agreements")
    p.add_argument(
        "--reshard",
        default="refuse",
        choices=["refuse", "reset-data"],
        help="resume a checkpoint saved by another number of ranks",
    )
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument(
        "--losses",
        help="per-rank JSON lines {step, loss}; '{rank}' in the path is filled in (else '.rank<N>' is appended)",
    )
    p.add_argument("--final", help="rank 0 saves the full model and optimizer state here on exit (torch.save)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s [rank " + os.environ.get("RANK", "0") + "] %(name)s: %(message)s",
    )
    cuda = torch.cuda.is_available()
    backend = "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        # NCCL refuses two ranks on one GPU: more ranks than GPUs on a node (a test rig) train over gloo
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
        backend = "gloo" if shared else "nccl"
    if dist.is_initialized():
        pass  # by a caller that runs main() more than once (tests/workers/dist_reshard.py)
    elif "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # plain `python train_ddp.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + rank)  # each rank its own dropout stream; DDP broadcasts rank 0's weights
    random.seed(args.seed + rank)  # every stream the Guard saves is seeded: two runs' checkpoints are equal
    np.random.seed(args.seed + rank)  # (`spotguard rehearse --reference` compares them, RNG streams included)

    dataset = CharWindows(make_text(), args.seq_len)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = StatefulDataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=args.num_workers
    )
    model = CharTransformer(len(dataset.vocab), args.seq_len, d=args.width).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))

    guard = spotguard.Guard(
        args.storage,
        every_steps=args.every_steps or None,
        keep=args.keep,
        providers=args.providers,
        interval=args.interval,
        deadline_policy=args.deadline_policy,
        sync_every=args.sync_every,
        reshard=args.reshard,
    )
    guard.track(model=ddp, optimizer=opt, scheduler=sched, loader=loader)
    step = start = guard.resume()
    epoch = int(guard.extra.get("epoch", 0))
    if rank == 0:
        print(
            f"[train_ddp] {world} ranks, {'resuming at' if start else 'starting at'} step {start} of {args.steps}",
            flush=True,
        )
    log = None
    if args.losses:
        path = args.losses.format(rank=rank) if "{rank}" in args.losses else f"{args.losses}.rank{rank}"
        log = open(path, "a")
    stopped = False
    t0 = time.monotonic()
    with guard:
        while step < args.steps and not stopped:
            sampler.set_epoch(epoch)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                if log:
                    log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                    log.flush()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if guard.step(step):
                    stopped = True
                    break
                if step >= args.steps:
                    break
            else:
                epoch += 1
                guard.extra["epoch"] = epoch
    if log:
        log.close()
    if args.final:
        state = {"model": get_model_state_dict(ddp), "optimizer": get_optimizer_state_dict(ddp, opt)}
        if rank == 0:
            torch.save(state, args.final)
    if stopped:
        n = guard.notice
        if rank == 0:
            print(
                f"[train_ddp] all {world} ranks stopped at step {step} ({n.kind if n else '?'} notice from "
                f"{n.provider if n else '?'}); checkpoint committed, exiting {spotguard.EXIT_PREEMPTED}",
                flush=True,
            )
        dist.destroy_process_group()
        return spotguard.EXIT_PREEMPTED
    if rank == 0:
        print(
            f"[train_ddp] finished {args.steps} steps ({step - start} in this run, {time.monotonic() - t0:.1f}s)",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
