"""Worker for tests/guard/test_teardown.py: a 2-rank training script as a user writes it from the README.

gloo, DDP (or FSDP2), AdamW, a StatefulDataLoader; a Guard tracks them, resumes, and the loop runs
inside ``with guard:``. Run by torchrun or as plain processes (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set: rank 0 hosts the store). ``--order`` is the teardown the program does:

  after   ``dist.destroy_process_group()`` after the block, as PyTorch recommends
  inside  ``dist.destroy_process_group()`` inside the block, before it ends
  none    the process group is never destroyed
  fsdp2   an FSDP2 model, destroyed after the block; nothing deleted first

``--sigterm-at N``: rank 1 sends itself SIGTERM after step N (every rank stops, emergency save).
Rank 0 prints ``resumed=R last=L stopped=S``; each rank prints how many gloo threads started after
its default group's are alive after the block (the Guard's: it must leave none behind). Exits 0, stopped or not.

``--fork-chain ORDER DIR FIRST LAST`` runs jobs FIRST..LAST of a chain (see ``job_args``) without
paying for ``import torch`` in every process: this process imports everything once, runs no torch
op, and forks both ranks of each job. A forked rank runs ``main()`` and then exits through
interpreter shutdown like any process, which is where the abort happened. Per job, ``DIR/run-I/``
gets ``out-R.log``, ``codes`` (the ranks' exit statuses, -N for signal N) and ``newest`` (the
newest checkpoint's step afterwards).

``--fork-chains ROOT FIRST LAST ORDER...`` does that for the chain of each order (in ``ROOT/ORDER``),
two chains at a time, each forked from one process that imported everything once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard import Guard
from spotguard.checkpoint import latest
from spotguard.storage import open_storage
from tests.helpers import wait_exit

KINDS = ("uninterrupted", "sigterm", "resumed")

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def gloo_tids() -> set[str]:
    """The ids of the threads named by gloo. A thread names itself once it runs, so one just
    started may not carry its name yet: tell threads apart by id, not by a count of names."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            if "gloo" in open(f"/proc/self/task/{tid}/comm").read():
                found.add(tid)
        except OSError:
            pass  # the thread ended meanwhile
    return found


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


def job_args(storage: Path, order: str, index: int, resume_at: int) -> list[str]:
    """Job ``index`` of a chain cycles through KINDS; it trains 5 steps past its resume point
    (checkpoints at even steps, so only the final checkpoint saves an odd last step)."""
    args = [str(storage), "--order", order, "--steps", str(resume_at + 5)]
    if KINDS[index % 3] == "sigterm":
        args += ["--sigterm-at", str(resume_at + 2)]
    return args


def newest_step(storage: Path) -> int:
    info = latest(open_storage(str(storage)))
    return info.step if info else 0


def _preload() -> None:
    import torch._dynamo  # noqa: F401  # DDP's constructor imports it: seconds per rank, paid once here
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401  # what the ranks would import, imported once (no torch op runs)

    import spotguard.checkpoint.sharded.sharded  # noqa: F401  # torch.distributed.checkpoint


def fork_chain(order: str, root: Path, first: int, last: int, timeout: float = 120) -> None:
    _preload()
    storage = root / "ckpt"
    for index in range(first, last + 1):
        work = root / f"run-{index}"
        work.mkdir()
        args = job_args(storage, order, index, newest_step(storage))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:  # the rank: its own output, environment and argv; exits by interpreter shutdown
                fd = os.open(work / f"out-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
                )
                sys.argv = [__file__, *args]
                sys.exit(main())
            pids.append(pid)
        codes = [wait_exit(pid, time.monotonic() + timeout, poll=0.05) for pid in pids]
        (work / "codes").write_text(" ".join(map(str, codes)))
        (work / "newest").write_text(str(newest_step(storage)))


def fork_chains(root: Path, first: int, last: int, orders: list[str], at_once: int = 2) -> int:
    """``fork_chain`` for each order (``root/ORDER``), ``at_once`` chains at a time, each in a process
    forked from this one: one ``import torch`` for every order's jobs. Exits 1 if a chain failed."""
    _preload()
    pending, running, failed = list(orders), {}, []
    while pending or running:
        while pending and len(running) < at_once:
            order = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the chain's launcher: it forks the ranks of each job, as --fork-chain does
                launcher = os.getpid()
                try:  # a rank (forked in there) leaves by its own SystemExit: interpreter shutdown
                    fork_chain(order, root / order, first, last)
                except Exception:
                    if os.getpid() != launcher:
                        raise  # a rank's error: its traceback and exit 1, as in a process of its own
                    import traceback

                    traceback.print_exc()
                    os._exit(1)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            running[pid] = order
        pid, status = os.wait()
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(running[pid])
        del running[pid]
    if failed:
        print(f"chains failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


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
    dist.barrier()  # the default group's threads exist from here on, though one may not have named itself yet:
    existing = set(os.listdir("/proc/self/task"))

    guard = Guard(args.storage, every_steps=2, providers="signal", busy="wait")  # every periodic save is made
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
    left = len(gloo_tids() - existing)  # gloo threads started since the default group's and still alive
    if args.order in ("after", "fsdp2"):
        dist.destroy_process_group()
    if rank == 0:
        sys.stdout.write(f"resumed={resumed} last={step} stopped={stopped}\n")
    sys.stdout.write(f"rank {rank} gloo threads started by the guard left after the block: {left}\n")  # one write
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork-chain"]:
        fork_chain(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        raise SystemExit(0)
    if sys.argv[1:2] == ["--fork-chains"]:
        raise SystemExit(fork_chains(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]))
    raise SystemExit(main())
