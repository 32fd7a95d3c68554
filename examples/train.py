"""Train a small character-level transformer under spotguard.

Stop it at any moment (SIGTERM, SIGUSR1, a notice file, a cloud notice) and start it again with
the same arguments: it resumes from the newest checkpoint and produces exactly the numbers an
uninterrupted run would have produced. Exit code 75 (``spotguard.EXIT_PREEMPTED``) means
"stopped for a notice, checkpoint committed".

    python examples/train.py --storage checkpoints/demo --steps 300 --every-steps 50
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
import warnings

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise

WORDS = (
    "spot machines are cheap but the cloud takes them back with a short notice so we save "
    "the state and resume exactly where training stopped every step counts and nothing is lost "
    "the model learns to spell these words one character at a time"
).split()


def make_text(n_chars: int = 24_000, seed: int = 1234) -> str:
    """A deterministic pseudo-language corpus (nothing downloaded; a private RNG, not the global one)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


class CharWindows(torch.utils.data.Dataset):
    def __init__(self, text: str, seq_len: int, vocab: list[str] | None = None) -> None:
        self.vocab = vocab or sorted(set(text))
        self.data = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(nn.Module):
    def __init__(
        self, vocab: int, seq_len: int, d: int = 64, heads: int = 4, layers: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(x) + self.pos[: x.shape[1]])
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(h)


def inject_fault(args: argparse.Namespace, step: int) -> None:
    """Crash or hang at a chosen step (rehearsing `spotguard run`); at most once per marker file."""
    if step not in (args.crash_at_step, args.hang_at_step):
        return
    if args.fault_marker:
        if os.path.exists(args.fault_marker):
            return
        open(args.fault_marker, "w").close()
    if step == args.crash_at_step:
        raise RuntimeError(f"simulated crash at step {step}")
    simulated_hang()


def simulated_hang() -> None:
    threading.Event().wait()  # blocks forever, like a stuck collective or data-loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--storage",
        help="checkpoint URL (path, s3://, gs://); default: $SPOTGUARD_STORAGE "
        "(set by `spotguard run --storage`), else checkpoints/example",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every-steps", type=int, default=50, help="periodic checkpoint interval (0: off)")
    p.add_argument("--every-seconds", type=float, default=None)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="metadata polling interval (s)")
    p.add_argument(
        "--deadline-policy",
        choices=("stop", "use-window"),
        help="after the emergency checkpoint: stop, or train on in the notice window and checkpoint again "
        "before the deadline (default: $SPOTGUARD_DEADLINE_POLICY, else stop)",
    )
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--width", type=int, default=64, help="model width (state size grows with its square)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for reproducibility)")
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="extra seconds per step and evaluation batch (long steps)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate on held-out text every N steps, inside guard.evaluation() (0: never)",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="batches per evaluation")
    p.add_argument("--losses", help="append one JSON line per step: {step, loss (float.hex)}")
    p.add_argument("--final", help="save the final model state_dict here (torch.save)")
    p.add_argument("--quiet", action="store_true")
    # Test-only faults for `spotguard run` rehearsals; with --fault-marker they fire once (while it is absent).
    p.add_argument("--crash-at-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hang-at-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fault-marker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)  # every stream the Guard saves is seeded: two runs' checkpoints are equal

    dataset = CharWindows(make_text(), args.seq_len)
    loader = StatefulDataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=args.num_workers
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = CharTransformer(len(dataset.vocab), args.seq_len, d=args.width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps - warmup)),
        ],
        milestones=[warmup],
    )
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")

    storage = args.storage or (None if os.environ.get("SPOTGUARD_STORAGE") else "checkpoints/example")
    guard = spotguard.Guard(
        storage,
        every_steps=args.every_steps or None,
        every_seconds=args.every_seconds,
        keep=args.keep,
        providers=args.providers,
        interval=args.interval,
        deadline_policy=args.deadline_policy,
    )
    guard.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)
    step = start = guard.resume()
    print(f"[train] {'resuming at' if start else 'starting at'} step {start} of {args.steps}", flush=True)
    log = open(args.losses, "a") if args.losses else None
    held_text = make_text(args.eval_batches * args.batch_size * args.seq_len + 1, seed=4321)
    held = CharWindows(held_text, args.seq_len, vocab=dataset.vocab)  # held-out text, indexed as in training
    rows = [held[i] for i in range(len(held))]
    batches = [
        (
            torch.stack([x for x, _ in rows[i : i + args.batch_size]]),
            torch.stack([y for _, y in rows[i : i + args.batch_size]]),
        )
        for i in range(0, args.eval_batches * args.batch_size, args.batch_size)
    ]

    def evaluate(at: int) -> bool:
        """The held-out loss after step ``at``, left early for a notice; True: stop (checkpoint committed).
        Dropout is off and the batches are fixed: an evaluation draws no random number."""
        model.eval()
        total, n = 0.0, 0
        with guard.evaluation() as ev, torch.no_grad():
            for x, y in batches:
                if ev.should_stop():
                    break
                total += nn.functional.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).item()
                n += 1
                if args.step_sleep:
                    time.sleep(args.step_sleep)
        model.train()
        if guard.step(at):  # the same step again: a stop here resumes into this evaluation
            return True
        guard.extra["evaluated"] = at  # after step(): a checkpoint of `at` from inside it repeats it
        if log and n:
            log.write(json.dumps({"step": at, "eval": (total / n).hex()}) + "\n")
            log.flush()
        return False

    stopped = False
    loss = None  # a run resumed at its last step trains no step
    t0 = time.monotonic()
    with guard:
        due = args.eval_every and start and start % args.eval_every == 0
        if due and guard.extra.get("evaluated") != start:  # stopped before or inside this evaluation
            stopped = evaluate(start)
        while step < args.steps and not stopped:
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                with torch.autocast(device, enabled=device == "cuda"):
                    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                step += 1
                if log:
                    log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                    log.flush()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if guard.step(step):
                    stopped = True
                    break
                if args.eval_every and step % args.eval_every == 0 and evaluate(step):
                    stopped = True
                    break
                inject_fault(args, step)
                if step >= args.steps:
                    break
    if log:
        log.close()
    if stopped:
        n = guard.notice
        print(
            f"[train] stopped at step {step} for a {n.kind if n else '?'} notice from "
            f"{n.provider if n else '?'}; checkpoint committed, exiting {spotguard.EXIT_PREEMPTED}",
            flush=True,
        )
        return spotguard.EXIT_PREEMPTED
    last = f"last loss {loss.item():.4f}" if loss is not None else "no step left to train"
    print(
        f"[train] finished {args.steps} steps ({step - start} in this run, {time.monotonic() - t0:.1f}s), {last}",
        flush=True,
    )
    if args.final:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
