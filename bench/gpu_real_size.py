"""A real-size state (fp32 model + AdamW) on the GPU: every spotguard figure beside its baseline, one run.

Rows, each named by the device that gave it (issue 33's targets in brackets):
  periodic stall (warm)     guard.step() of a due periodic save, against a plain copy of the same tensors
                            into preallocated pinned buffers, and against dcp.async_save's return
  staging reserved          the first step's background allocation of the (pinned) staging, off the loop
  first stall               the first periodic save of the process, once reserved, against a warm one [<= 1.5x]
  periodic write            the background write of that save, against the disk's sequential-write
                            floor (O_DIRECT, the same bytes, this run)
  emergency                 notice to commit, against the periodic write [<= 1.15x], the disk floor
                            [<= 1.3x] and torch.save + fsync
  estimate                  what the emergency's log line estimated, against what it took [within 25%]
  resume cold / warm        Guard.resume() into a fresh model, against torch.load(mmap=True) +
                            load_state_dict [>= 1.0x both]
  step slowdown             training steps while a background write runs, against ones without: a real
                            batch [<= 3%] and a launch-bound one (information)
  30 s state                the largest state that commits within a 30 s notice at the emergency's rate

Sized to the machine (``--size-gb``, default: about 9 GB on a GPU, kept under a quarter of the host memory
and of the disk's free space; 0.5 GB without CUDA, where the rows say "cpu" and only check the script).
Run by ``make gpu-check``; ``--device cpu`` forces the CPU.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _rows import emit, parser, row  # noqa: E402

import spotguard  # noqa: E402
from spotguard import Notice  # noqa: E402

#: The resume rows' target: on a GPU both sides copy every byte to the device; on the CPU the baseline's
#: AdamW ``load_state_dict`` keeps the mapped tensors unread (same device, no copy), a third of the bytes
#: read against a verified resume that hashes all of them: there the rows are information.
RESUME_TARGET = {True: "<= 1.0x time", False: "info (cpu: the baseline leaves the optimizer state unread)"}
WIDTH = 4096  # Linear(4096, 4096): 16.8M parameters, 201 MB of fp32 + AdamW state per layer
#: Training steps timed beside a background write: a step of a real batch (on an H200 ~0.1 s, arithmetic
#: and memory bound), and a launch-bound one of 64 rows (a few ms, mostly Python and kernel launches: it
#: shows the write's threads competing for the GIL).
BATCHES = (1024, 64)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} CPUs)"


def default_size_gb(device: str, root: Path) -> float:
    if device != "cuda":
        return 0.5
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    disk = shutil.disk_usage(root).free / 1e9
    gpu = torch.cuda.get_device_properties(0).total_memory / 1e9
    return max(1.0, min(9.0, host / 4, disk / 4, gpu / 3))


def build(size_gb: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW with its moments created: 12 bytes of state per parameter."""
    per_layer = WIDTH * WIDTH * 12
    layers = max(1, round(size_gb * 1e9 / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt, device)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, batch: int = 64) -> None:
    x = torch.randn(batch, WIDTH, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)


def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str, batch: int) -> float:
    t0 = time.perf_counter()
    step(model, opt, device, batch)
    return time.perf_counter() - t0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def pinned_copy(ts: list[torch.Tensor]) -> float:
    """The floor for any snapshot: one copy into buffers allocated beforehand."""
    bufs = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in ts]
    t0 = time.perf_counter()
    torch._foreach_copy_(bufs, ts, non_blocking=True)
    sync("cuda" if ts[0].is_cuda else "cpu")
    took = time.perf_counter() - t0
    del bufs
    return took


def disk_floor(root: Path, nbytes: int) -> float:
    """Sequential O_DIRECT write of ``nbytes`` and fsync: what the disk can take."""
    from spotguard.checkpoint.files.fileio import DirectFile

    block = bytes(64 << 20)
    t0 = time.perf_counter()
    with DirectFile(root / "floor.bin") as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
    took = time.perf_counter() - t0
    (root / "floor.bin").unlink()
    return took


def torch_save_fsync(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    path = root / "plain.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    return took


def dcp_async_stall(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> float | None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=str(root / "dcp"))
        took = time.perf_counter() - t0
        fut.result()
        return took
    except Exception as e:  # not every torch build has it working on every device
        print(f"dcp.async_save: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    finally:
        dist.destroy_process_group()


def drop_cache(root: Path) -> None:
    """Every file under ``root`` out of the page cache (synced first: a dirty page is not dropped)."""
    for path in [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_in(root: Path) -> None:
    """Every file under ``root`` into the page cache: a warm pair starts warm on both sides (the cold
    baseline's drop_cache also drops the checkpoint that was read before it)."""
    for path in [p for p in root.rglob("*") if p.is_file()]:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    args = ap.parse_args()
    dev = args.device
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="sg-real-") as tmp:
        root = Path(tmp)
        size_gb = args.size_gb or default_size_gb(dev, root)
        model, opt = build(size_gb, dev)
        ts = tensors(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        gb = nbytes / 1e9
        name = f"{device_name(dev)}, {gb:.2f} GB"
        print(f"state: {gb:.2f} GB on {device_name(dev)}", flush=True)

        copy_s = statistics.median(pinned_copy(ts) for _ in range(3))
        floor_s = disk_floor(root, nbytes)

        # Periodic saves: the first (its staging reserved off the loop) and warm ones, the background write,
        # training steps beside it. every_steps=2: the first step() (not due) starts reserving the staging
        # after a training step, as in a real run; the first due save here comes once that reservation has
        # ended (its time is a row of its own): a real run's first save comes many steps later.
        g = spotguard.Guard(str(root / "ckpt"), providers=[], every_steps=2, keep=1, busy="wait", save_on_exit=False)
        g.track(model=model, optimizer=opt)
        g.resume()
        stalls, writes = [], []
        busy: dict[int, list[float]] = {b: [] for b in BATCHES}
        idle: dict[int, list[float]] = {b: [] for b in BATCHES}
        with g:
            t0 = time.perf_counter()
            g.step(1)
            step(model, opt, dev)
            reserving = getattr(getattr(g.saves.engine, "_staging", None), "_reserving", None)
            if reserving is not None:
                reserving.join()
            reserve_s = time.perf_counter() - t0
            for s in range(2, 10, 2):
                t0 = time.perf_counter()
                g.step(s)
                stalls.append(time.perf_counter() - t0)
                while g.saves.in_flight() is not None:  # training steps while the write runs
                    for b in BATCHES:
                        busy[b].append(timed_step(model, opt, dev, b))
                g.wait()
                writes.append(g.stats().write_s or 0.0)
                for _ in range(3):
                    for b in BATCHES:
                        idle[b].append(timed_step(model, opt, dev, b))
                g.step(s + 1)  # not due
            # The emergency save: a notice with a 30 s deadline, at a step after the last periodic one.
            estimate = g.saves.stats.durable_seconds(two_tiers=g.saves.engine.two_tiers)
            g.watcher.report(
                Notice("bench", "terminate", deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30))
            )
            t0 = time.perf_counter()
            g.step(11)
            emergency_s = time.perf_counter() - t0
        first, warm = stalls[0], statistics.median(stalls[1:])
        write_s = statistics.median(writes[1:])
        slowdown = {b: statistics.median(busy[b]) / statistics.median(idle[b]) for b in BATCHES if busy[b]}

        save_s = torch_save_fsync(root, model, opt)
        (root / "plain.pt").unlink()
        dcp_s = dcp_async_stall(root, model, opt)
        shutil.rmtree(root / "dcp", ignore_errors=True)

        # Resume into a fresh model: cold (page cache dropped) and warm, against torch.load(mmap) + load_state_dict.
        del g, ts
        plain = root / "plain.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain)
        del model, opt
        gc.collect()
        fresh, fresh_opt = build(size_gb, dev)
        ours, base = {}, {}
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_cache(root)
            else:
                read_in(root)
            g2 = spotguard.Guard(str(root / "ckpt"), providers=[], save_on_exit=False)
            g2.track(model=fresh, optimizer=fresh_opt)
            t0 = time.perf_counter()
            g2.resume()
            sync(dev)
            ours[cache] = time.perf_counter() - t0
            if cache == "cold":
                drop_cache(root)
            t0 = time.perf_counter()
            sd = torch.load(plain, map_location="cpu", weights_only=True, mmap=True)
            fresh.load_state_dict(sd["model"])
            fresh_opt.load_state_dict(sd["optimizer"])
            sync(dev)
            base[cache] = time.perf_counter() - t0
            del sd

    on_gpu = dev != "cpu"
    rows = [
        row(
            f"periodic stall (warm), {name}",
            warm,
            "s",
            baseline=copy_s,
            baseline_label="plain copy into preallocated pinned buffers",
            target="<= 1.5x",
            passed=lambda v, r: r is not None and r <= 1.5,
        ),
        row(
            f"periodic stall vs dcp.async_save, {name}",
            warm,
            "s",
            baseline=dcp_s,
            baseline_label="dcp.async_save until it returns",
            target="ratio < 1",
            passed=None if dcp_s is None else (lambda v, r: r is not None and r < 1),
        ),
        row(
            f"staging reserved off the loop after the first step, {name}",
            reserve_s,
            "s",
            target="info (the first save waits for it when due sooner)",
        ),
        row(
            f"first periodic stall, {name}",
            first,
            "s",
            baseline=warm,
            baseline_label="a warm stall, same run",
            target="<= 1.5x",
            passed=lambda v, r: r is not None and r <= 1.5,
        ),
        row(
            f"periodic write (background), {name}",
            gb / write_s,
            "GB/s",
            baseline=gb / floor_s,
            baseline_label="O_DIRECT sequential write + fsync, same bytes",
            target="info",
        ),
        row(
            f"emergency, notice to commit, {name}",
            emergency_s,
            "s",
            baseline=write_s,
            baseline_label="the periodic write of the same state",
            target="<= 1.15x",
            passed=lambda v, r: r is not None and r <= 1.15,
        ),
        row(
            f"emergency vs the disk floor, {name}",
            emergency_s,
            "s",
            baseline=floor_s,
            baseline_label="O_DIRECT sequential write + fsync, same bytes",
            target="<= 1.3x",
            passed=lambda v, r: r is not None and r <= 1.3,
        ),
        row(
            f"emergency vs torch.save, {name}",
            emergency_s,
            "s",
            baseline=save_s,
            baseline_label="torch.save + fsync",
            target="ratio < 1",
            passed=lambda v, r: r is not None and r < 1,
        ),
        row(
            f"emergency estimate, {name}",
            estimate or 0.0,
            "s",
            baseline=emergency_s,
            baseline_label="the emergency save's actual time",
            target="0.75x-1.25x",
            passed=lambda v, r: r is not None and 0.75 <= r <= 1.25,
        ),
        row(
            f"resume (cold cache), {name}",
            ours["cold"],
            "s",
            baseline=base["cold"],
            baseline_label="torch.load(mmap=True) + load_state_dict",
            target=RESUME_TARGET[on_gpu],
            passed=(lambda v, r: r is not None and r <= 1.0) if on_gpu else None,
        ),
        row(
            f"resume (warm cache), {name}",
            ours["warm"],
            "s",
            baseline=base["warm"],
            baseline_label="torch.load(mmap=True) + load_state_dict",
            target=RESUME_TARGET[on_gpu],
            passed=(lambda v, r: r is not None and r <= 1.0) if on_gpu else None,
        ),
        *[
            row(
                f"step time during a background write, batch {b}, {name}",
                ratio,
                "x",
                # On the CPU the step and the write's copy and hashing threads share the same cores.
                target=(
                    "info (cpu: the step and the write share its cores)"
                    if not on_gpu
                    else "<= 1.03"
                    if b == BATCHES[0]
                    else "info (launch-bound: the GIL is shared with the write)"
                ),
                passed=(lambda v, r: v <= 1.03) if on_gpu and b == BATCHES[0] else None,
            )
            for b, ratio in slowdown.items()
        ],
        row(f"largest state committed within a 30 s notice, {name}", 30.0 * gb / emergency_s, "GB", target="info"),
    ]
    emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
