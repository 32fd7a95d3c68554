"""A Guard epoch loop with an evaluation that draws random numbers (dropout left on, a random
augmentation), stopped by SIGTERM in the middle of an evaluation (after the epoch's last batch).

    python tests/workers/eval_cut.py --storage ckpt --log log.jsonl [--notice-epoch 1] [--num-workers 2] [--every-steps 6]

``--eval-first`` also evaluates before the first training step, as epoch -1 (nanoGPT evaluates at iteration 0).

Each line of ``--log`` is ``[kind, step or epoch, value]``; the final weights go to ``--final``.
Exits 75 after a notice. Used by tests/guard/test_evaluation.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 noise


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--final", default="")
    p.add_argument("--notice-epoch", type=int, default=None)
    p.add_argument("--notice-batch", type=int, default=1)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every-steps", type=int, default=0, help="periodic checkpoints (0: none)")
    p.add_argument("--eval-first", action="store_true", help="evaluate before the first training step too")
    a = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(24)]
    kw = {}
    if a.num_workers:
        import multiprocessing

        # Each epoch's workers fork from the forkserver: with torch imported there once, not in each of them.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torchdata.stateful_dataloader"])
        kw = {"multiprocessing_context": ctx}
    loader = StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), num_workers=a.num_workers, **kw
    )
    guard = spotguard.Guard(a.storage, providers="signal", every_steps=a.every_steps or None, async_save=False)
    guard.track(model=model, optimizer=opt, loader=loader)
    step = guard.resume()
    epoch = guard.extra.get("epoch", 0)
    log = open(a.log, "a")  # noqa: SIM115 - one file for the whole run

    def emit(*row: object) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()

    def evaluate(epoch: int) -> bool:
        """Evaluate after training step ``step``; True when a notice cut it short (stop)."""
        with guard.evaluation() as ev, torch.no_grad():  # dropout stays on: the draws matter
            for i in range(4):
                if epoch == a.notice_epoch and i == a.notice_batch:
                    os.kill(os.getpid(), signal.SIGTERM)
                    guard.preempted.wait(60)  # the watcher's thread raises the flag: inside this evaluation
                if ev.should_stop():
                    break
                x = data[i][0] + 0.1 * torch.randn(4)  # a random augmentation
                emit("eval", epoch, model(x).item())
        return guard.step(step)

    with guard:
        if a.eval_first and step == 0 and evaluate(-1):
            return spotguard.EXIT_PREEMPTED
        while epoch < a.epochs:
            model.train()
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                emit("train", step, loss.item())
                if guard.step(step):
                    return spotguard.EXIT_PREEMPTED
            if evaluate(epoch):
                return spotguard.EXIT_PREEMPTED
            epoch += 1
            guard.extra["epoch"] = epoch
    if a.final:
        torch.save(model.state_dict(), a.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
