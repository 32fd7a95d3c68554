"""A user's script, not ours: a character-level LSTM language model trained with truncated
backpropagation through time, written from the README alone.

What makes it hard to resume exactly: the LSTM's hidden state is carried from batch to batch
within an epoch (reset at each epoch), EMA weights are kept in a plain dict, the learning rate
steps once per epoch after the batch loop, and the epoch counter lives in ``guard.extra``. Used by
tests/test_thirdparty.py: stopped with SIGINT (through ``spotguard run``) or SIGTERM at a random
step, it must resume to the same per-step losses and the same final weights as an uninterrupted run.

    python tests/workers/thirdparty_charlstm.py --storage ckpt --epochs 3 --losses losses.jsonl --final final.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
import warnings

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise

TEXT = (
    "it was the best of times it was the worst of times it was the age of wisdom it was the age of "
    "foolishness it was the epoch of belief it was the epoch of incredulity it was the season of light "
) * 3


class Streams(torch.utils.data.Dataset):
    """Batch i holds characters [i*bptt, (i+1)*bptt) of each of ``streams`` parallel slices of the text,
    so batch i+1 continues batch i and the hidden state carries over (classic char-RNN batching)."""

    def __init__(self, text: str, streams: int, bptt: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        per = (len(ids) - 1) // streams
        self.x = ids[: per * streams].view(streams, per)
        self.y = ids[1 : per * streams + 1].view(streams, per)
        self.bptt = bptt

    def __len__(self) -> int:
        return self.x.shape[1] // self.bptt

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = slice(i * self.bptt, (i + 1) * self.bptt)
        return self.x[:, s], self.y[:, s]


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, d: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, hidden):  # type: ignore[no-untyped-def]
        out, hidden = self.lstm(self.drop(self.emb(x)), hidden)
        return self.head(self.drop(out)), hidden


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every-steps", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--losses")
    p.add_argument("--final")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # spotguard's logs too
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)

    data = Streams(TEXT, streams=4, bptt=16)
    loader = StatefulDataLoader(data, batch_size=None, shuffle=False)  # each item is already a batch
    model = CharLSTM(len(data.vocab))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped once per epoch
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a plain dict of tensors
    hidden = spotguard.Value(None)  # rebound every batch: a holder, as the README says
    tokens = spotguard.Value(0)

    guard = spotguard.Guard(args.storage, every_steps=args.every_steps, keep=10, providers="signal")
    guard.track(model=model, optimizer=opt, scheduler=sched, loader=loader, ema=ema, hidden=hidden, tokens=tokens)
    step = guard.resume()
    epoch = guard.extra.get("epoch", 0)
    print(f"[charlstm] start at step {step}, epoch {epoch}", flush=True)
    log = open(args.losses, "a") if args.losses else None
    stopped = False
    with guard:
        while epoch < args.epochs and not stopped:
            for x, y in loader:  # after a resume: the rest of the epoch (nothing after its last batch)
                logits, h = model(x, hidden.value)
                hidden.value = tuple(t.detach() for t in h)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        ema[k].mul_(0.9).add_(v, alpha=0.1)
                tokens.value += y.numel()
                step += 1
                if log:
                    log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
                    log.flush()
                time.sleep(args.step_sleep)
                if guard.step(step):
                    stopped = True
                    break
            if stopped:
                break
            sched.step()  # after the epoch's last guard.step(): only the final checkpoint sees it
            hidden.value = None
            epoch += 1
            guard.extra["epoch"] = epoch
    if log:
        log.close()
    if stopped:
        print(f"[charlstm] stopped at step {step}", flush=True)
        return spotguard.EXIT_PREEMPTED
    print(f"[charlstm] done at step {step}, {tokens.value} tokens", flush=True)
    if args.final:
        torch.save({"model": model.state_dict(), "ema": ema, "tokens": tokens.value}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
