"""Per-step cost of each trainer integration when nothing is due, beside an empty callback.

What a training step pays: for the Hugging Face Trainer, ``SpotguardCallback.on_step_begin`` +
``on_step_end`` (the hooks it runs once per optimizer step) against ``TrainerCallback``'s empty
ones, with the Trainer's real ``TrainerState``/``TrainerControl``; for Accelerate,
``AcceleratorGuard.step()`` against an empty method; for Lightning, the callback's
``on_train_batch_start`` + ``on_before_optimizer_step`` + ``on_train_batch_end`` against
``Callback``'s empty ones, with a real ``lightning.Trainer``. Target: the overhead, value minus
baseline, < 1 us per step (both measured in the same run: a loaded machine inflates both alike).
In a process group every integration votes once per step (``NoticeWatch.check``: one all-reduce of
one int on a gloo group): measured on 2 real gloo ranks against the bare all-reduce it wraps.
"""

from __future__ import annotations

import sys
import tempfile
import timeit

from _rows import emit, parser, row

TARGET_NS = 1000.0
TARGET = "overhead (value - baseline) < 1000 ns"


def per_call_ns(stmt, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e9


class _Empty:
    def step(self, step: int) -> bool:
        return False


def hf(root: str, n: int) -> dict:
    from transformers import TrainerCallback, TrainerControl, TrainerState

    from spotguard.integrations.hf import SpotguardCallback

    cb, empty = SpotguardCallback(root, providers=[]), TrainerCallback()
    state, control = TrainerState(global_step=10), TrainerControl()
    ours = per_call_ns(lambda: (cb.on_step_begin(None, state, control), cb.on_step_end(None, state, control)), n)
    base = per_call_ns(lambda: (empty.on_step_begin(None, state, control), empty.on_step_end(None, state, control)), n)
    return row(
        "HF SpotguardCallback per step, nothing due (on_step_begin + on_step_end)",
        ours,
        "ns",
        baseline=base,
        baseline_label="empty TrainerCallback",
        target=TARGET,
        passed=lambda v, r: v - base < TARGET_NS,
    )


def accelerate(root: str, n: int) -> dict:
    from spotguard.integrations.accelerate import AcceleratorGuard

    class _Accelerator:  # AcceleratorGuard.step() never touches the accelerator when nothing is due
        project_configuration = None

    guard, empty = AcceleratorGuard(_Accelerator(), root, every_steps=10**9, providers=[]), _Empty()
    ours = per_call_ns(lambda: guard.step(10), n)
    base = per_call_ns(lambda: empty.step(10), n)
    return row(
        "Accelerate AcceleratorGuard.step(), nothing due (every_steps)",
        ours,
        "ns",
        baseline=base,
        baseline_label="empty method call",
        target=TARGET,
        passed=lambda v, r: v - base < TARGET_NS,
    )


def lightning(root: str, n: int) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from spotguard.integrations.lightning import SpotguardCallback

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cb, empty = SpotguardCallback(root, every_steps=10**9, providers=[]), Callback()

    def ours_step() -> None:
        cb.on_train_batch_start(trainer, None, None, 0)
        cb.on_before_optimizer_step(trainer, None, None)
        cb.on_train_batch_end(trainer, None, None, None, 0)

    def empty_step() -> None:
        empty.on_train_batch_start(trainer, None, None, 0)
        empty.on_before_optimizer_step(trainer, None, None)
        empty.on_train_batch_end(trainer, None, None, None, 0)

    ours, base = per_call_ns(ours_step, n), per_call_ns(empty_step, n)
    return row(
        "Lightning SpotguardCallback per step, nothing due (3 hooks)",
        ours,
        "ns",
        baseline=base,
        baseline_label="empty Callback",
        target=TARGET,
        passed=lambda v, r: v - base < TARGET_NS,
    )


def _group_rank(rank: int, port: int, n: int, out: str) -> None:
    """One of 2 gloo ranks: ``NoticeWatch.check`` (the vote every integration runs per step in a process
    group) against the bare all-reduce of one int64 it is built on, on a group of the same kind."""
    import json
    import os

    import torch
    import torch.distributed as dist

    from spotguard.integrations._common import NoticeWatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    watch = NoticeWatch(providers=[])
    watch.group.settle()
    bare, flag = dist.new_group(backend="gloo"), torch.zeros(1, dtype=torch.int64)
    for _ in range(200):  # warm both
        watch.check(1), dist.all_reduce(flag, group=bare)
    # Interleaved rounds, the best of each: a loaded machine's drift hits both alike.
    ours_runs, base_runs = [], []
    for _ in range(9):
        ours_runs.append(per_call_ns(lambda: watch.check(1), n, repeat=1))
        base_runs.append(per_call_ns(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=bare), n, repeat=1))
    ours, base = min(ours_runs), min(base_runs)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([ours, base], f)
    watch.group.close()
    dist.destroy_process_group()


def group_vote(n: int) -> dict:
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s, tempfile.NamedTemporaryFile(suffix=".json") as out:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_group_rank, args=(port, n, out.name), nprocs=2)
        ours, base = json.load(open(out.name))
    return row(
        "any integration per step in a 2-rank process group, nothing due (the vote)",
        ours,
        "ns",
        baseline=base,
        baseline_label="bare gloo all-reduce of one int",
        target=TARGET,
        passed=lambda v, r: v - base < TARGET_NS,
    )


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=300_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rows = [hf(root, args.number), accelerate(root, args.number), lightning(root, args.number)]
    rows.append(group_vote(max(1000, args.number // 100)))
    emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
