"""Train a small model with Hugging Face Accelerate under spotguard (``pip install 'spotguard[hf,data]'``).

Stop it at any moment (SIGTERM, SIGUSR1, a cloud notice) and start it again with the same
arguments: it resumes from the newest checkpoint that verifies and produces exactly the losses
an uninterrupted run would have. Exit code 75 (``spotguard.EXIT_PREEMPTED``) after a notice.

    python examples/accelerate_train.py --storage checkpoints/accelerate --steps 200 --every-steps 50
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard.integrations.accelerate import AcceleratorGuard


class Progress:
    """Anything with state_dict()/load_state_dict() can ride along (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = state["samples"]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))


def evaluate(
    model: nn.Module, data: torch.utils.data.TensorDataset, guard, step: int, trace, augment: bool
) -> float | None:
    """Mean loss on held-out data, cut short (None) when a notice arrives: the checkpoint comes first.
    ``augment``: dropout stays on and the inputs get random noise (draws that a resume must repeat)."""
    model.train(augment)
    total = 0.0
    with guard.evaluation(step) as ev, torch.no_grad():  # after training step `step`
        for i in range(0, len(data), 8):
            if ev.should_stop():  # a stop notice (on any rank: the same answer on all)
                model.train()
                return None
            x, y = (t.to(next(model.parameters()).device) for t in data[i : i + 8])
            if augment:
                x = x + 0.1 * torch.randn_like(x)
            total += nn.functional.mse_loss(model(x), y).item()
            trace("eval_batch")
    model.train()
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", help="checkpoint URL (path, s3://, gs://); default $SPOTGUARD_STORAGE")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=50, help="periodic checkpoint interval (0: off)")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-augment", action="store_true", help="evaluate with dropout on and noisy inputs")
    p.add_argument(
        "--save-before-eval",
        action="store_true",
        help="call guard.step(step) before an evaluation too, so a periodic checkpoint of that step lands before it",
    )
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument(
        "--deadline-policy",
        choices=("stop", "use-window"),
        help="after the emergency checkpoint: stop, or train on in the notice window and checkpoint again "
        "before the deadline (default: $SPOTGUARD_DEADLINE_POLICY, else stop)",
    )
    p.add_argument("--window-margin", type=float, default=5.0, help="use-window: seconds kept free (beyond the save)")
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
    p.add_argument("--eval-sleep", type=float, default=0.0, help="extra seconds per evaluation batch (rehearsals)")
    p.add_argument(
        "--eval-sleep-step", type=int, help="--eval-sleep in the evaluation of this step only (default: every one)"
    )
    p.add_argument("--warmup-sleep", type=float, default=0.0, help="extra seconds before the first step (rehearsals)")
    p.add_argument("--trace", help="append one JSON line per event: train_begin, eval_batch (rehearsals)")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (one per rank; NCCL under torchrun)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    set_seed(
        args.seed
    )  # Python's, NumPy's and torch's: every stream save_state keeps, so two runs' checkpoints are equal
    g = torch.Generator().manual_seed(1)  # the data: made here, from its own generator
    train = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    held_out = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
    accelerator = Accelerator(
        cpu=not args.cuda, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=max(1, args.steps // 10))
    loader = StatefulDataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    progress = Progress()

    guard = AcceleratorGuard(
        accelerator,
        args.storage,
        every_steps=args.every_steps or None,
        providers=args.providers,
        interval=args.interval,
        deadline_policy=args.deadline_policy,
        window_margin=args.window_margin,
        rebatch=args.rebatch,
    )
    guard.track(progress)
    step = guard.resume()  # 0 when there is no checkpoint
    log = open(args.losses, "a") if args.losses and accelerator.is_main_process else None  # one writer
    trace_file = open(args.trace, "a") if args.trace else None

    def trace(event: str) -> None:
        if trace_file:
            trace_file.write(json.dumps({"event": event, "step": step}) + "\n")
            trace_file.flush()

    with guard:
        trace("train_begin")
        time.sleep(args.warmup_sleep)  # e.g. compiling, loading data: a notice now stops before any step
        stopped = guard.step(step)

        def evaluation() -> None:
            def batch_done(event: str) -> None:
                trace(event)
                time.sleep(args.eval_sleep if args.eval_sleep_step in (None, step) else 0.0)

            evaluate(model, held_out, guard, step, batch_done, args.eval_augment)

        if guard.resumed_in_evaluation and not stopped:
            evaluation()  # the one a notice cut short: again from its start, with the same draws
            stopped = guard.step(step)
        while step < args.steps and not stopped:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                step += 1
                progress.samples += len(x)
                if log:
                    log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                    log.flush()
                time.sleep(args.step_sleep)
                if args.eval_steps and step % args.eval_steps == 0:
                    if args.save_before_eval and guard.step(step):  # a periodic save of `step` comes first
                        stopped = True
                        break
                    evaluation()
                if guard.step(step) or step >= args.steps:  # after the evaluation: a notice in it counts too
                    stopped = guard.stopped_at is not None
                    break
    if log:
        log.close()
    if guard.exit_code:
        n = guard.notice
        print(
            f"[accelerate] stopped at step {step} for a {n.kind if n else '?'} notice from "
            f"{n.provider if n else '?'}; exiting {guard.exit_code}",
            flush=True,
        )
        return guard.exit_code
    print(f"[accelerate] finished {step} steps ({progress.samples} samples seen)", flush=True)
    if args.final:
        weights = accelerator.get_state_dict(model)  # collective under FSDP (gathers the shards): every rank
        if accelerator.is_main_process:
            torch.save({k: v.detach().clone() for k, v in weights.items()}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
