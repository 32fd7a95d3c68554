"""Emergency checkpoint of a 2-rank DeepSpeed ZeRO-2 job through spotguard, against ``engine.save_checkpoint`` alone.

Two gloo ranks on CPU (``DS_ACCELERATOR=cpu``) train a stack of ``Linear(width, width)`` layers with
AdamW under ZeRO-2 (weights in ``mp_rank_00_model_states.pt``, each rank's optimizer partition in a
file of its own). Ours: a notice reaches rank 1 only; the clock runs from that moment (both ranks
at the same step, the watcher has seen it) until ``guard.step()`` returns True on the slowest rank:
the vote, ``engine.save_checkpoint`` into each rank's scratch folder (each file hashed and synced as
DeepSpeed closes it), the per-rank state file, the store (hard links on the same disk) and the manifest. Baselines,
measured in the same run on the same disk: ``engine.save_checkpoint`` into a local folder alone (no
fsync, no checksums: what a DeepSpeed job does today), and followed by an fsync of its files (the
plain way to make it durable). Medians over ``--repeat`` rounds, each after a warm-up round.

    python bench/deepspeed_emergency.py [--width 2048] [--layers 6] [--repeat 5]
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _rows import emit, parser, row  # noqa: E402
from torch import nn  # noqa: E402

ALONE = "engine.save_checkpoint into a local folder, no fsync"
DURABLE = "engine.save_checkpoint + fsync of its files"


def slowest(seconds: float, world: int) -> float:
    times = [0.0] * world
    dist.all_gather_object(times, seconds)
    return max(times)


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def emergency(engine: object, storage: str, notice_file: Path, rank: int, world: int) -> tuple[float, int]:
    """Seconds from a notice on rank 1 to the committed checkpoint (slowest rank), and its size."""
    from spotguard.integrations.deepspeed import DeepSpeedGuard

    guard = DeepSpeedGuard(engine, storage, providers="file", interval=0.01, save_on_exit=False)
    with guard:
        assert guard.step(1) is False
        if rank == 1:
            notice_file.write_text("{}")
            while not guard.notices.due:
                time.sleep(0.001)
        dist.barrier()
        t0 = time.perf_counter()
        assert guard.step(2) is True and guard.emergency_error is None, guard.emergency_error
        took = time.perf_counter() - t0
    if rank == 1:
        notice_file.unlink()
    assert guard.checkpoints.last_saved is not None
    return slowest(took, world), guard.checkpoints.last_saved.size


def plain(engine: object, folder: Path, world: int, durable: bool) -> float:
    """Seconds of ``engine.save_checkpoint`` into a local folder (slowest rank), with or without fsync."""
    folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(str(folder), tag="bench")  # type: ignore[attr-defined]
    if durable:
        fsync_tree(folder)
    return slowest(time.perf_counter() - t0, world)


def worker(
    rank: int, world: int, port: int, width: int, layers: int, repeat: int, tmp: str, json_path: str | None
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        SPOTGUARD_NOTICE_FILE=f"{tmp}/notice-{{rank}}",
    )
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel("ERROR")
    logging.getLogger("spotguard").setLevel(logging.ERROR)  # no "emergency checkpoint committed" lines
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, width)).square().mean()
    engine.backward(loss)
    engine.step()  # AdamW's moments exist: the checkpoint holds the whole training state

    ours, alone, durable, size = [], [], [], 0
    for i in range(repeat + 1):  # round 0 warms up (first save_checkpoint, page cache)
        took, size = emergency(engine, f"{tmp}/spotguard-{i}", Path(f"{tmp}/notice-1"), rank, world)
        ours.append(took)
        alone.append(plain(engine, Path(tmp) / f"plain-{i}-rank{rank}", world, durable=False))
        durable.append(plain(engine, Path(tmp) / f"durable-{i}-rank{rank}", world, durable=True))
    if rank == 0:
        t_ours, t_alone, t_durable = (statistics.median(t[1:]) for t in (ours, alone, durable))
        mb = size / 1e6
        print(f"state: {layers} x Linear({width},{width}) + AdamW, ZeRO-2 on {world} gloo ranks, {mb:.0f} MB on disk")
        print(f"spotguard emergency (notice->commit): {t_ours:6.3f}s  rounds {[f'{t:.3f}' for t in ours[1:]]}")
        print(f"engine.save_checkpoint alone:         {t_alone:6.3f}s  rounds {[f'{t:.3f}' for t in alone[1:]]}")
        print(f"engine.save_checkpoint + fsync:       {t_durable:6.3f}s  rounds {[f'{t:.3f}' for t in durable[1:]]}")
        print(f"ratio: {t_ours / t_alone:.2f}x save_checkpoint alone, {t_ours / t_durable:.2f}x with fsync")
        figure = f"DeepSpeed ZeRO-2 emergency notice->commit, 2 ranks, {mb:.0f} MB (local disk)"
        emit(
            [
                row(f"{figure}, vs save_checkpoint", t_ours, "s", baseline=t_alone, baseline_label=ALONE),
                row(f"{figure}, vs save_checkpoint + fsync", t_ours, "s", baseline=t_durable, baseline_label=DURABLE),
            ],
            json_path,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        mp.spawn(worker, args=(2, port, args.width, args.layers, args.repeat, tmp, args.json), nprocs=2)


if __name__ == "__main__":
    main()
