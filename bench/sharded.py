"""Sharded checkpoints on N gloo ranks: save/resume throughput, and the loop's stall per async save.

Every rank holds the same model + AdamW state (as under DDP); DCP writes each tensor once, spread
over the ranks, through spotguard's storage interface (local directory here). Baselines, measured
in the same run: the single-process ``Guard`` (one ``torch.save`` file) of the same state for
throughput; for the stall of a periodic (async) save, ``guard.step()`` on a due step against the
host copy of the rank's state dict into preallocated buffers (the floor: target <= 1.5x) and
against ``torch.distributed.checkpoint.async_save`` of the same state (time until it returns).
Stalls are the slowest rank's, medians over ``--repeat`` saves after a warm-up. Host memory staged
per rank (the most of any rank) against the rank's whole state: DCP's plan gives each replicated
item to one rank, and only that rank copies it (``sharded_plan``).

    python bench/sharded.py [--ranks 2] [--width 2048] [--layers 2] [--repeat 3]
"""

from __future__ import annotations

import os
import socket
import statistics
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


def slowest(seconds: float, world: int) -> float:
    times = [0.0] * world
    dist.all_gather_object(times, seconds)
    return max(times)


def stalls(
    model: nn.Module, opt: torch.optim.Optimizer, tmp: str, world: int, repeat: int
) -> tuple[float, float, float, int, int]:
    """(guard.step stall, host copy, dcp.async_save stall), each the slowest rank's median; the most bytes
    any rank staged, and the bytes of a rank's whole state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    guard = Guard(
        f"{tmp}/async", providers=None, every_steps=1, busy="wait", keep=1, async_sharded=True, save_on_exit=False
    ).track(model=model, optimizer=opt)
    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    pairs = [
        (torch.empty_like(t), t)
        for t in [
            v
            for part in (sd["model"].values(), *(s.values() for s in sd["optimizer"]["state"].values()))
            for v in part
            if isinstance(v, torch.Tensor)
        ]
    ]
    ours, copies, theirs = [], [], []
    with guard:
        for step in range(1, repeat + 2):  # the first one allocates the staging buffers
            guard.wait()
            dist.barrier()
            copies.append(slowest(timed(lambda: [b.copy_(t) for b, t in pairs]), world))
            dist.barrier()
            ours.append(slowest(timed(lambda step=step: guard.step(step)), world))
        guard.wait()
    staged = [0] * world
    dist.all_gather_object(staged, guard.saves.engine.staged_bytes)
    whole = sum(t.numel() * t.element_size() for _, t in pairs)
    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{tmp}/dcp-{i}")
        took = time.perf_counter() - t0
        fut.result()  # its thread runs collectives on the default group: no gather before it is done
        theirs.append(slowest(took, world))
    return statistics.median(ours[1:]), statistics.median(copies[1:]), statistics.median(theirs[1:]), max(staged), whole


def worker(
    rank: int, world: int, port: int, width: int, layers: int, tmp: str, json_path: str | None, repeat: int = 3
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model, opt = build(width, layers)
    results = {}
    if rank == 0:  # baseline: one process, one file
        single = Guard(f"{tmp}/single", providers=None).track(model=model, optimizer=opt)
        t_save = timed(lambda: single.save(1))
        size = single.last_saved.size
        m1, o1 = build(width, layers)
        fresh = Guard(f"{tmp}/single", providers=None).track(model=m1, optimizer=o1)
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
    stall, copy, dcp_stall, staged, whole = stalls(model, opt, tmp, world, repeat)
    times = [None] * world
    dist.all_gather_object(times, (t_save, t_load))
    if rank == 0:
        t_save, t_load = max(t for t, _ in times), max(t for _, t in times)  # the slowest rank ends the save
        s_size, s_save, s_load = results["single"]
        mb = 1e6
        print(f"state: {layers} x Linear({width},{width}) + AdamW; ranks: {world} (gloo), local storage")
        print(f"sharded save  ({world} ranks): {size / mb:7.1f} MB in {t_save:6.3f}s = {size / mb / t_save:7.1f} MB/s")
        print(f"sharded load  ({world} ranks): {size / mb:7.1f} MB in {t_load:6.3f}s = {size / mb / t_load:7.1f} MB/s")
        print(
            f"baseline save (1 process):   {s_size / mb:7.1f} MB in {s_save:6.3f}s = {s_size / mb / s_save:7.1f} MB/s"
        )
        print(
            f"baseline load (1 process):   {s_size / mb:7.1f} MB in {s_load:6.3f}s = {s_size / mb / s_load:7.1f} MB/s"
        )
        print(
            f"ratio sharded/baseline throughput: save {(size / t_save) / (s_size / s_save):.2f}x, "
            f"load {(size / t_load) / (s_size / s_load):.2f}x"
        )
        state_mb = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / mb  # weights + 2 AdamW moments
        emit(
            [
                row(
                    f"sharded save, {world} ranks, {size / mb:.0f} MB (DCP, local)",
                    size / mb / t_save,
                    "MB/s",
                    baseline=s_size / mb / s_save,
                    baseline_label="single-process Guard.save",
                ),
                row(
                    f"sharded load, {world} ranks, {size / mb:.0f} MB (DCP, local)",
                    size / mb / t_load,
                    "MB/s",
                    baseline=s_size / mb / s_load,
                    baseline_label="single-process Guard.resume",
                ),
                row(
                    f"async sharded save stall, {world} ranks, {state_mb:.0f} MB per rank, vs host copy",
                    stall * 1e3,
                    "ms",
                    baseline=copy * 1e3,
                    baseline_label="copy of the rank's state dict into host buffers",
                    target="<= 1.5x",
                    passed=lambda v, r: r <= 1.5,
                ),
                row(
                    f"async sharded save stall, {world} ranks, {state_mb:.0f} MB per rank, vs dcp.async_save",
                    stall * 1e3,
                    "ms",
                    baseline=dcp_stall * 1e3,
                    baseline_label="dcp.async_save until it returns",
                    target="info",
                    passed=None,
                ),
                row(
                    f"async sharded save, host memory staged per rank, {world} ranks (DDP: replicated state)",
                    staged / mb,
                    "MB",
                    baseline=whole / mb,
                    baseline_label="the rank's whole state dict",
                    target=f"<= {1.5 / world:.2f}x",
                    passed=lambda v, r: r <= 1.5 / world,
                ),
            ],
            json_path,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="async saves timed (after one warm-up)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        mp.spawn(
            worker, args=(args.ranks, port, args.width, args.layers, tmp, args.json, args.repeat), nprocs=args.ranks
        )


if __name__ == "__main__":
    main()
