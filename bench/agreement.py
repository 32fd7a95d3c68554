"""Per-step cost of the stop agreement (one all-reduce MAX of an int64 on a gloo group), 2 ranks.

Prints, from rank 0: ``guard.step()`` in a process group with nothing due (the agreement), the
same call in a single process (baseline: no collective), and one training step of the DDP example
model (the time the agreement is paid against), with the ratios.

    python bench/agreement.py [--ranks 2] [--steps 3000]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "examples"), str(REPO / "bench")]

from _rows import emit, parser, row  # noqa: E402
from train import CharTransformer  # noqa: E402

from spotguard import Guard  # noqa: E402


def per_call(fn, n: int) -> float:
    fn(0)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        fn(i)
    return (time.perf_counter() - t0) / n


def worker(rank: int, world: int, port: int, steps: int, tmp: str, json_path: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Baseline first, before any process group exists: the single-process fast path.
    single = Guard(f"{tmp}/single-{rank}", providers=None)
    base = per_call(single.step, steps * 20)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard = Guard(f"{tmp}/dist", providers=None)
    dist.barrier()
    agreed = per_call(guard.step, steps)
    every8 = Guard(f"{tmp}/dist8", providers=None, sync_every=8)
    dist.barrier()
    agreed8 = per_call(every8.step, steps)

    torch.manual_seed(rank)
    model = DistributedDataParallel(CharTransformer(40, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 40, (16, 32)), torch.randint(0, 40, (16, 32))

    def train_step(_: int) -> None:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()

    step_time = per_call(train_step, 50)
    if rank == 0:
        print(f"ranks: {world} (gloo, 127.0.0.1, 1 thread each)")
        print(f"guard.step(), single process (baseline, no collective): {base * 1e6:9.3f} us")
        print(
            f"guard.step(), agreement every step:                      {agreed * 1e6:9.1f} us"
            f"  ({agreed / base:,.0f}x the baseline)"
        )
        print(f"guard.step(), sync_every=8:                              {agreed8 * 1e6:9.1f} us per step")
        print(f"one DDP training step of the example model:             {step_time * 1e3:9.2f} ms")
        print(f"agreement / training step: {agreed / step_time:.2%} (sync_every=8: {agreed8 / step_time:.2%})")
        label = "one DDP step of the example model"
        emit(
            [
                row(
                    f"agreement all-reduce per step, {world} gloo ranks",
                    agreed * 1e3,
                    "ms",
                    baseline=step_time * 1e3,
                    baseline_label=label,
                ),
                row(
                    f"agreement with sync_every=8, {world} gloo ranks",
                    agreed8 * 1e3,
                    "ms",
                    baseline=step_time * 1e3,
                    baseline_label=label,
                ),
            ],
            json_path,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args.ranks, port, args.steps, tmp, args.json), nprocs=args.ranks)


if __name__ == "__main__":
    main()
