"""Sharded checkpoint throughput: ``Guard.save``/``resume`` with DCP on N ranks vs one process.

Every rank holds the same model + AdamW state (as under DDP); DCP writes each tensor once, spread
over the ranks, through spotguard's storage interface (local directory here). The baseline is the
single-process ``Guard`` (one ``torch.save`` file) of the same state, measured in the same run.

    python bench/sharded.py [--ranks 2] [--width 2048] [--layers 2]
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from _rows import emit, parser, row  # noqa: E402

from spotguard import Guard  # noqa: E402


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, width: int, layers: int, tmp: str,
           json_path: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model, opt = build(width, layers)
    results = {}
    if rank == 0:  # baseline: one process, one file
        single = Guard(f"{tmp}/single", providers=None).track(model=model, optimizer=opt)
        t_save = timed(lambda: single.save(1))
        size = single.last_saved.size
        fresh = Guard(f"{tmp}/single", providers=None).track(model=build(width, layers)[0])
        t_load = timed(fresh.resume)
        results["single"] = (size, t_save, t_load)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard = Guard(f"{tmp}/sharded", providers=None).track(model=model, optimizer=opt)
    dist.barrier()
    t_save = timed(lambda: guard.save(1))
    size = guard.last_saved.size
    m2, o2 = build(width, layers)
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    fresh = Guard(f"{tmp}/sharded", providers=None).track(model=m2, optimizer=o2)
    dist.barrier()
    t_load = timed(fresh.resume)
    assert all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), model.state_dict().values(), strict=True))
    times = [None] * world
    dist.all_gather_object(times, (t_save, t_load))
    if rank == 0:
        t_save, t_load = max(t for t, _ in times), max(t for _, t in times)  # the slowest rank ends the save
        s_size, s_save, s_load = results["single"]
        mb = 1e6
        print(f"state: {layers} x Linear({width},{width}) + AdamW; ranks: {world} (gloo), local storage")
        print(f"sharded save  ({world} ranks): {size / mb:7.1f} MB in {t_save:6.3f}s = {size / mb / t_save:7.1f} MB/s")
        print(f"sharded load  ({world} ranks): {size / mb:7.1f} MB in {t_load:6.3f}s = {size / mb / t_load:7.1f} MB/s")
        print(f"baseline save (1 process):   {s_size / mb:7.1f} MB in {s_save:6.3f}s = {s_size / mb / s_save:7.1f} MB/s")
        print(f"baseline load (1 process):   {s_size / mb:7.1f} MB in {s_load:6.3f}s = {s_size / mb / s_load:7.1f} MB/s")
        print(f"ratio sharded/baseline throughput: save {(size / t_save) / (s_size / s_save):.2f}x, "
              f"load {(size / t_load) / (s_size / s_load):.2f}x")
        emit([row(f"sharded save, {world} ranks, {size / mb:.0f} MB (DCP, local)", size / mb / t_save, "MB/s",
                  baseline=s_size / mb / s_save, baseline_label="single-process Guard.save"),
              row(f"sharded load, {world} ranks, {size / mb:.0f} MB (DCP, local)", size / mb / t_load, "MB/s",
                  baseline=s_size / mb / s_load, baseline_label="single-process Guard.resume")], json_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        mp.spawn(worker, args=(args.ranks, port, args.width, args.layers, tmp, args.json), nprocs=args.ranks)


if __name__ == "__main__":
    main()
