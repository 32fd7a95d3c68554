"""Emergency checkpoint through each trainer integration, against that trainer's own save alone.

Issue 33's point 9: an integration saves through the trainer's own code and adds what a checkpoint
needs (the commit: files hashed, synced and stored, the manifest last); the target is at most 1.2x
the trainer's save alone. One process on the CPU per trainer, the same state for each: a stack of
``Linear(width, width)`` layers with AdamW (its moments made by a first step), written to local disk.

Ours: the seconds the integration's stop spends writing the emergency checkpoint (the trainer's save
and the commit), after a notice file seen by its watcher: the span ``StopProtocol.write`` times for
Accelerate and Lightning, and for HF the span its callback times from the Trainer's own write to the
commit (the Trainer writes the folder between two callbacks). Baselines, in the same run on the same disk: the trainer's own save into a local
folder (``Accelerator.save_state``; ``Trainer._save_checkpoint``, what the HF Trainer runs at
``save_steps``; Lightning's ``Trainer.save_checkpoint``), alone and followed by an fsync of its files
(the plain way to make it durable). Medians over ``--repeat`` rounds after a warm-up round.

    python bench/trainer_emergency.py [--width 2048] [--layers 4] [--repeat 3] [--only accelerate,hf,lightning]
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402
from _rows import emit, parser, row  # noqa: E402
from torch import nn  # noqa: E402

from spotguard.coordination import stopping  # noqa: E402

ALONE, DURABLE = "alone, into a local folder, no fsync", "followed by an fsync of its files"
TARGET = "<= 1.2x"


class Stack(nn.Module):
    """``layers`` x Linear(width, width); called with ``labels`` it returns HF's ``{"loss": ...}``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        y = self.net(x)
        return {"loss": (y - labels).square().mean() if labels is not None else y.square().mean()}


class Timed:
    """The seconds of each stop's checkpoint write (``StopProtocol.write``: every integration's stop)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        real = stopping.StopProtocol.write

        def write(proto, step, do, resume_step):  # type: ignore[no-untyped-def]
            error, took = real(proto, step, do, resume_step)
            assert error is None, error
            self.seconds.append(took)
            return error, took

        stopping.StopProtocol.write = write  # type: ignore[method-assign]


def fsync_tree(root: Path) -> None:
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def timed(fn: Callable[[], object], durable_root: Path | None = None) -> float:
    t0 = time.perf_counter()
    fn()
    if durable_root is not None:
        fsync_tree(durable_root)
    return time.perf_counter() - t0


def notice(path: Path, watch: object) -> None:
    """A notice file, and a wait until the integration's watcher has seen it."""
    path.write_text("{}")
    while not watch.due:  # type: ignore[attr-defined]
        time.sleep(0.001)


def accelerate_round(tmp: Path, i: int, width: int, layers: int, timer: Timed) -> tuple[float, float, float]:
    from accelerate import Accelerator

    from spotguard.integrations.accelerate import AcceleratorGuard

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = Stack(width, layers)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    acc.backward(model(torch.randn(2, width))["loss"])
    opt.step()
    guard = AcceleratorGuard(acc, str(tmp / f"acc-{i}"), providers="file", interval=0.01, save_on_exit=False)
    with guard:
        assert guard.step(1) is False
        notice(tmp / "notice", guard.notices)
        assert guard.step(2) is True and guard.emergency_error is None, guard.emergency_error
    (tmp / "notice").unlink()
    alone = timed(lambda: acc.save_state(str(tmp / f"acc-plain-{i}")))
    durable = timed(lambda: acc.save_state(str(tmp / f"acc-durable-{i}")), tmp / f"acc-durable-{i}")
    return timer.seconds[-1], alone, durable


def hf_round(tmp: Path, i: int, width: int, layers: int, timer: Timed) -> tuple[float, float, float]:
    import transformers

    from spotguard.integrations.hf import SpotguardCallback

    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / f"hf-out-{i}"),
        max_steps=50,
        per_device_train_batch_size=2,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    cb = SpotguardCallback(str(tmp / f"hf-{i}"), providers="file", interval=0.01)
    path = tmp / "notice"

    class Injector(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                notice(path, cb.notices)

    data = [{"x": torch.randn(width), "labels": torch.randn(width)} for _ in range(8)]
    trainer = transformers.Trainer(model=Stack(width, layers), args=args, train_dataset=data, callbacks=[Injector()])
    assert cb.train(trainer) == 75 and cb.emergency_error is None and cb._save_s is not None
    ours = cb._save_s  # the HF stop times its commit from the Trainer's own write (``began``), not in write()
    path.unlink()
    args.output_dir = str(tmp / f"hf-plain-{i}")  # a folder of its own: never over the committed files
    alone = timed(lambda: trainer._save_checkpoint(trainer.model, trial=None))
    args.output_dir = str(tmp / f"hf-durable-{i}")
    durable = timed(lambda: trainer._save_checkpoint(trainer.model, trial=None), Path(args.output_dir))
    return ours, alone, durable


def lightning_round(tmp: Path, i: int, width: int, layers: int, timer: Timed) -> tuple[float, float, float]:
    import lightning as L

    from spotguard.integrations.lightning import SpotguardCallback

    torch.manual_seed(0)
    path = tmp / "notice"
    cb = SpotguardCallback(str(tmp / f"pl-{i}"), providers="file", interval=0.01)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.stack = Stack(width, layers)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.stack(*batch)["loss"]

        def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if self.trainer.global_step == 2 and not path.exists():
                notice(path, cb.notices)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, width), torch.randn(16, width)), batch_size=2
    )
    quiet = {f"enable_{x}": False for x in ("checkpointing", "progress_bar", "model_summary")}
    trainer = L.Trainer(max_steps=50, accelerator="cpu", logger=False, callbacks=[cb], **quiet)
    module = Module()
    before = len(timer.seconds)
    assert cb.fit(trainer, module, train_dataloaders=data) == 75 and len(timer.seconds) == before + 1
    path.unlink()
    alone = timed(lambda: trainer.save_checkpoint(tmp / f"pl-plain-{i}.ckpt"))
    durable = timed(lambda: trainer.save_checkpoint(tmp / f"pl-durable-{i}" / "last.ckpt"), tmp / f"pl-durable-{i}")
    return timer.seconds[-1], alone, durable


TRAINERS = {
    "accelerate": ("Accelerate AcceleratorGuard", "Accelerator.save_state", accelerate_round),
    "hf": ("HF Trainer SpotguardCallback", "Trainer._save_checkpoint", hf_round),
    "lightning": ("Lightning SpotguardCallback", "Trainer.save_checkpoint", lightning_round),
}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default=",".join(TRAINERS))
    args = p.parse_args()
    logging.getLogger("spotguard").setLevel(logging.ERROR)
    for name in ("transformers", "lightning", "lightning.pytorch", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    mb = args.layers * (args.width * args.width + args.width) * 4 * 3 / 1e6
    timer, rows = Timed(), []
    for key in args.only.split(","):
        label, theirs, round_ = TRAINERS[key]
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            os.environ["SPOTGUARD_NOTICE_FILE"] = f"{tmp}/notice"
            results = [round_(Path(tmp), i, args.width, args.layers, timer) for i in range(args.repeat + 1)]
        ours, alone, durable = (statistics.median(r[k] for r in results[1:]) for k in range(3))
        print(f"{label}: emergency {ours:.3f}s, {theirs} {alone:.3f}s, + fsync {durable:.3f}s  ({mb:.0f} MB of state)")
        figure = f"{label} emergency checkpoint, {mb:.0f} MB (local disk)"
        rows += [
            row(
                f"{figure}, vs {theirs}",
                ours,
                "s",
                baseline=alone,
                baseline_label=f"{theirs} {ALONE}",
                target=TARGET,
                passed=lambda v, r: r is not None and r <= 1.2,
            ),
            row(f"{figure}, vs {theirs} + fsync", ours, "s", baseline=durable, baseline_label=f"{theirs} {DURABLE}"),
        ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
