"""Train a tiny GPT-2 with the Hugging Face Trainer under spotguard (``pip install 'spotguard[hf]'``).

Stop it at any moment (SIGTERM, SIGUSR1, a cloud notice) and start it again with the same
arguments: it resumes from the newest checkpoint that verifies and produces exactly the losses
an uninterrupted run would have. Exit code 75 (``spotguard.EXIT_PREEMPTED``) means "stopped for
a notice, checkpoint committed": SkyPilot's ``recover_on_exit_codes: [75]`` relaunches it.

    python examples/hf_trainer.py --storage checkpoints/hf --steps 200 --every-steps 50

The model is built from a config and the data is made in memory: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from spotguard.integrations.hf import SpotguardCallback


class Tokens(torch.utils.data.Dataset):
    """Random token sequences from a private generator (the global RNG streams stay the Trainer's)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.augment = augment  # test-time augmentation: a random roll, from the global stream

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i].roll(int(torch.randint(0, len(self.ids[i]), (1,)))) if self.augment else self.ids[i]
        return {"input_ids": ids, "labels": ids}


class Rehearsal(TrainerCallback):
    """Test hooks: the exact loss of every step, events traced, slower warm-up, steps and evaluations."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.log = open(args.losses, "a") if args.losses else None
        self.trace = open(args.trace, "a") if args.trace else None
        self.args = args

    def event(self, name: str, step: int) -> None:
        if self.trace:
            self.trace.write(json.dumps({"event": name, "step": step}) + "\n")
            self.trace.flush()

    def on_train_begin(self, args, state, control, **kwargs):
        self.event("train_begin", state.global_step)
        time.sleep(self.args.warmup_sleep)  # e.g. compiling, loading data

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.log and logs and "loss" in logs and state.is_world_process_zero:  # under torchrun: once
            self.log.write(json.dumps({"step": state.global_step, "loss": float(logs["loss"]).hex()}) + "\n")
            self.log.flush()

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.args.step_sleep)

    def on_prediction_step(self, args, state, control, **kwargs):
        self.event("eval_batch", state.global_step)
        if self.args.eval_sleep_step in (None, state.global_step):
            time.sleep(self.args.eval_sleep)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", help="checkpoint URL (path, s3://, gs://); default $SPOTGUARD_STORAGE")
    p.add_argument("--output-dir", default="hf-output", help="the Trainer's own folder (local disk)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=50, help="the Trainer's save_steps (0: only on notices)")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--rebatch",
        choices=("refuse", "accept"),
        default="refuse",
        help="resumed with another --batch-size than the checkpoint's: refuse, or train on as the Trainer does",
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
    p.add_argument("--deepspeed", type=int, choices=[0, 1, 2, 3], help="train through DeepSpeed, this ZeRO stage")
    p.add_argument("--cuda", action="store_true", help="train on the GPU (one per rank; NCCL under torchrun)")
    p.add_argument("--eval-augment", action="store_true", help="evaluations draw random numbers (a random roll)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def deepspeed_config(stage: int) -> dict:
    """A DeepSpeed config for the Trainer ("auto": the Trainer fills in its own values); torch's AdamW,
    so no op is compiled."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    transformers.utils.logging.disable_progress_bar()
    if args.deepspeed is not None:  # before DeepSpeed is imported: it picks its accelerator then
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.cuda else "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    train, evaluation = Tokens(256, 16, 64, seed=1), Tokens(32, 16, 64, seed=2, augment=args.eval_augment)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        warmup_steps=10,
        seed=args.seed,
        use_cpu=not args.cuda,
        report_to=[],
        save_strategy="steps" if args.every_steps else "no",
        save_steps=args.every_steps or 500,
        save_total_limit=2,  # the Trainer's local folder; spotguard keeps its own copies in --storage
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=8,
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=None if args.deepspeed is None else deepspeed_config(args.deepspeed),
    )
    spot = SpotguardCallback(args.storage, providers=args.providers, interval=args.interval, rebatch=args.rebatch)
    trainer = Trainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=evaluation, callbacks=[spot, Rehearsal(args)]
    )
    code = spot.train(trainer)  # resumes from the newest checkpoint that verifies
    if code:
        n = spot.notices.notice
        print(
            f"[hf] stopped at step {spot.stopped_at} for a {n.kind if n else '?'} notice from "
            f"{n.provider if n else '?'}; exiting {code}",
            flush=True,
        )
        return code
    print(f"[hf] finished {trainer.state.global_step} steps", flush=True)
    if args.final and trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
