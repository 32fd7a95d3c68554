"""Train a small model with Lightning under spotguard (``pip install 'spotguard[lightning,data]'``).

Stop it at any moment (SIGTERM, SIGUSR1, a cloud notice) and start it again with the same
arguments: it resumes from the newest checkpoint that verifies (``ckpt_path``) and produces exactly
the losses an uninterrupted run would have. Exit code 75 (``spotguard.EXIT_PREEMPTED``) after a notice.

    python examples/lightning_train.py --storage checkpoints/lightning --steps 200 --every-steps 50
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spotguard.integrations.lightning import SpotguardCallback

warnings.filterwarnings("ignore", message=".*(set_vital|does not have many workers|LitLogger).*")


class Regressor(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
        self.log_file = open(args.losses, "a") if args.losses else None
        self.trace_file = open(args.trace, "a") if args.trace else None

    def trace(self, event: str) -> None:
        if self.trace_file:
            self.trace_file.write(json.dumps({"event": event, "step": self.trainer.global_step}) + "\n")
            self.trace_file.flush()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (
            self.log_file and self.trainer.is_global_zero
        ):  # the step's exact loss, after the optimizer step (global_step counts it)
            self.log_file.write(
                json.dumps({"step": self.trainer.global_step, "loss": outputs["loss"].item().hex()}) + "\n"
            )
            self.log_file.flush()
        time.sleep(self.args.step_sleep)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.args.eval_augment:  # test-time augmentation: random numbers drawn during validation
            x = x + 0.1 * torch.randn_like(x)
        self.trace("eval_batch")
        if self.args.eval_sleep_step in (None, self.trainer.global_step):
            time.sleep(self.args.eval_sleep)
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self):
        self.trace("train_begin")
        time.sleep(self.args.warmup_sleep)  # e.g. compiling, loading data

    def setup(self, stage):
        # Each rank its own dropout (after Lightning's per-fit reseed; DDP takes the weights from rank 0):
        # a resume must bring back every rank's streams, not rank 0's only.
        if self.trainer.world_size > 1:
            torch.manual_seed(self.args.seed + 1000 * self.global_rank)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=max(1, self.args.steps // 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", help="checkpoint URL (path, s3://, gs://); default $SPOTGUARD_STORAGE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=50, help="periodic checkpoint interval (0: off)")
    p.add_argument("--eval-steps", type=int, default=0, help="validate every N steps (0: never)")
    p.add_argument("--eval-epochs", action="store_true", help="validate at each epoch's end (Lightning's default)")
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes")
    p.add_argument(
        "--rebatch",
        choices=("refuse", "accept"),
        default="refuse",
        help="resumed with another --batch-size than the checkpoint's: refuse, or continue at the same sample",
    )
    p.add_argument("--losses", help="append one JSON line per step: {step, loss (float.hex)}")
    p.add_argument("--final", help="save the final model state_dict here (torch.save)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (rehearsals)")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="extra seconds per validation batch (rehearsals)")
    p.add_argument(
        "--eval-sleep-step", type=int, help="--eval-sleep in the validation of this step only (default: every one)"
    )
    p.add_argument("--warmup-sleep", type=float, default=0.0, help="extra seconds before the first step (rehearsals)")
    p.add_argument("--trace", help="append one JSON line per event: train_begin, eval_batch (rehearsals)")
    p.add_argument("--eval-augment", action="store_true", help="validation draws random numbers (noisy inputs)")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="under torchrun: DDP or FSDP")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (one per rank; NCCL under torchrun)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def strategy(args: argparse.Namespace, world: int) -> Any:
    if args.strategy == "ddp":
        return "ddp" if world > 1 else "auto"
    from lightning.pytorch.strategies import FSDPStrategy

    if args.cuda:
        return FSDPStrategy(state_dict_type="sharded")  # each rank writes its shard: see docs/integrations.md

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning refuses FSDP on the CPU (by the strategy's exact type) and hands torch no device, while
        torch's FSDP runs on the CPU over gloo when told so: this subclass lets the CPU tests run it."""

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs
            )

    return CPUFSDPStrategy(state_dict_type="sharded")


def final_weights(args: argparse.Namespace, trainer: L.Trainer, model: L.LightningModule) -> dict[str, torch.Tensor]:
    """The whole model's weights; under FSDP gathered from every rank's shard (so called on every rank)."""
    if args.strategy != "fsdp":
        return {k: v.detach().clone() for k, v in model.net.state_dict().items()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        return {k: v.detach().cpu().clone() for k, v in model.net.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(1)  # the data: made here, from its own generator
    train = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    held_out = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
    model = Regressor(args)
    # Under torchrun: one Lightning process per rank (DDP over gloo). Lightning's own distributed
    # sampler keeps no shuffle state: torchdata's StatefulDistributedSampler resumes exactly.
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    sampler = (
        StatefulDistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        if world > 1
        else None
    )

    spot = SpotguardCallback(
        args.storage,
        every_steps=args.every_steps or None,
        providers=args.providers,
        interval=args.interval,
        rebatch=args.rebatch,
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cuda" if args.cuda else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy(args, world),
        use_distributed_sampler=False,
        callbacks=[spot],
        logger=False,
        enable_checkpointing=False,  # spotguard commits the checkpoints (ModelCheckpoint may be kept too)
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=args.eval_steps or None,
        check_val_every_n_epoch=None if args.eval_steps else 1,
        limit_val_batches=None if args.eval_steps or args.eval_epochs else 0,
    )
    code = spot.fit(
        trainer,
        model,
        train_dataloaders=StatefulDataLoader(
            train, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler, num_workers=args.num_workers
        ),
        val_dataloaders=StatefulDataLoader(held_out, batch_size=8),
    )
    if code:
        n = spot.notices.notice
        print(
            f"[lightning] stopped at step {spot.stopped_at} for a {n.kind if n else '?'} notice from "
            f"{n.provider if n else '?'}; exiting {code}",
            flush=True,
        )
        return code
    print(f"[lightning] finished {trainer.global_step} steps", flush=True)
    if args.final:
        weights = final_weights(args, trainer, model)
        if trainer.is_global_zero:
            torch.save(weights, args.final)
    return 0


def run(argv: list[str] | None = None) -> int:
    """``main``, then the process group Lightning started is destroyed, as PyTorch recommends, and
    what still holds it (the trainer and its FSDP modules, kept in reference cycles) is collected
    while the interpreter is whole: a gloo group released only at the interpreter's exit aborts the
    process now and then ("terminate called without an active exception", exit -6), after a run
    that finished (1 to 2 runs in 16 of the FSDP test's job)."""
    try:
        return main(argv)
    finally:
        gc.collect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    sys.exit(run())
