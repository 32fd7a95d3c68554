"""Train a small model with DeepSpeed (ZeRO stage 0-3) under spotguard (``pip install 'spotguard[deepspeed,data]'``).

A notice on any rank (a signal to one process, a per-rank notice file, a node's cloud metadata)
stops every rank after the same step, with one checkpoint written by ``engine.save_checkpoint`` on
every rank; run the same command again to resume exactly. On CPU (gloo):

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 --master-addr 127.0.0.1 \\
        examples/deepspeed_train.py --storage checkpoints/deepspeed --zero-stage 2
    SPOTGUARD_NOTICE_FILE='/tmp/notice-{rank}' ... --providers file   # touch /tmp/notice-1: all ranks stop

The `deepspeed` launcher works the same way (`deepspeed --num_gpus 2 examples/deepspeed_train.py ...`).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import random
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spotguard.integrations.deepspeed import DeepSpeedGuard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", help="checkpoint URL (path, s3://, gs://); default $SPOTGUARD_STORAGE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=50, help="periodic checkpoint interval (0: off)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument("--work-dir", help="where a resume fetches its copy ('{rank}' is filled in); default: temp dir")
    p.add_argument("--width", type=int, default=64, help="hidden width of the model")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (rehearsals)")
    p.add_argument(
        "--losses", help="JSON lines {step, loss (float.hex)}: rank 0's, or every rank's with '{rank}' in the path"
    )
    p.add_argument("--final", help="rank 0 saves the final model state_dict here (torch.save)")
    p.add_argument("--trace", help="rank 0 appends one JSON line per event: train_begin (rehearsals)")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (one per rank; NCCL under torchrun)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 3e-3}},
        # partition even this small model's parameters under ZeRO-3 (the default keeps small ones whole)
        "zero_optimization": {"stage": args.zero_stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1 << 30,
    }


def make_job(args: argparse.Namespace) -> tuple[Any, StatefulDataLoader, StatefulDistributedSampler]:
    """The engine, the loader and its sampler; the same weights on every rank, dropout seeded per rank."""
    import deepspeed

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1)  # the data: made here, from its own generator
    dataset = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = StatefulDataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(args.width, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    torch.manual_seed(args.seed + 1000 + rank)  # each rank its own dropout stream
    random.seed(args.seed + rank)  # every stream the checkpoint keeps is seeded: two runs' checkpoints are equal
    np.random.seed(args.seed + rank)
    return engine, loader, sampler


def train(
    args: argparse.Namespace, engine: Any, loader: Any, sampler: Any, guard: DeepSpeedGuard, step: int, log: Any
) -> int:
    """Train from ``step`` to ``args.steps`` or a notice; the last step done."""
    epoch = int(guard.extra.get("epoch", 0))
    stopped = guard.step(step)  # a notice during the start-up stops before the first step
    while step < args.steps and not stopped:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)  # a no-op on the CPU
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            step += 1
            if log:
                log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                log.flush()
            time.sleep(args.step_sleep)
            if guard.step(step):
                stopped = True
                break
            if step >= args.steps:
                break
        else:
            epoch += 1
            guard.extra["epoch"] = epoch
    return step


def final_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The whole model's weights (collective: ZeRO-3 gathers its partitioned parameters on every rank)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def setup(args: argparse.Namespace) -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s [rank " + rank + "] %(name)s: %(message)s",
    )
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.cuda else "cpu")
    import deepspeed  # after DS_ACCELERATOR: it picks its accelerator at import
    from deepspeed.utils import logger as ds_logger

    if args.quiet:
        ds_logger.setLevel(logging.ERROR)
    if "RANK" not in os.environ:  # plain `python deepspeed_train.py`: a group of one (no MPI discovery)
        with socket.socket() as s:  # a free port, not a fixed one: two such jobs on one machine must not clash
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if args.cuda:  # one GPU per rank on this node, before NCCL picks one
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend="nccl" if args.cuda else "gloo")
    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup(args)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, loader, sampler = make_job(args)
    guard = DeepSpeedGuard(
        engine,
        args.storage,
        every_steps=args.every_steps or None,
        keep=args.keep,
        providers=args.providers,
        interval=args.interval,
        work_dir=args.work_dir.format(rank=rank) if args.work_dir else None,
    )
    guard.track(loader=loader)
    start = guard.resume()  # 0 when there is no checkpoint
    if rank == 0:
        print(f"[deepspeed] {world} ranks, ZeRO-{args.zero_stage}, starting at step {start}", flush=True)
    log = None
    if args.losses and ("{rank}" in args.losses or rank == 0):
        log = open(args.losses.format(rank=rank), "a")
    if args.trace and rank == 0:
        with open(args.trace, "a") as trace:
            trace.write(json.dumps({"event": "train_begin", "step": start}) + "\n")
    t0 = time.monotonic()
    with guard:
        step = train(args, engine, loader, sampler, guard, start, log)
    if log:
        log.close()
    if guard.exit_code:
        n = guard.notice
        print(
            f"[deepspeed] rank {rank} of {world} stopped at step {step} ({n.kind if n else '?'} notice from "
            f"{n.provider if n else '?'}); exiting {guard.exit_code}",
            flush=True,
        )
        return guard.exit_code
    if args.final:
        weights = final_weights(engine)
        if rank == 0:
            torch.save(weights, args.final)
    if rank == 0:
        print(f"[deepspeed] finished {args.steps} steps ({step - start} in this run, {time.monotonic() - t0:.1f}s)")
    return 0


def exit_process(main: Callable[[], int]) -> NoReturn:
    """Run ``main``, then end a DeepSpeed process as ``sys.exit`` would (its exit code, a traceback for an
    error, the other threads waited for, the exit handlers run), but without the interpreter's teardown of
    its modules, and with the process group destroyed first.

    Why: DeepSpeed holds the group until that teardown, even after ``deepspeed.comm.destroy_process_group()``
    (ZeRO-3 keeps the model on a module-level stack, and its parameters hold the group), and a gloo group
    released while Python finalizes aborts the process now and then after a run that finished ("terminate
    called without an active exception", exit -6: once so far in CI, in the ZeRO-3 test).
    """
    try:
        code = main()
    except SystemExit as e:  # argparse: --help, a bad option
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    import deepspeed.comm

    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's own references to the groups
    for thread in threading.enumerate():  # as the interpreter waits for them at its exit
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging, temporary folders: everything `sys.exit` runs, with the interpreter whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main)
