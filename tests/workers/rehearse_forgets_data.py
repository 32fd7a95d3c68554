"""A job that resumes everything but its data position (for ``spotguard rehearse --reference``).

A linear model on batches drawn from a private generator that is NOT tracked: after a resume the
batches start over, so the losses part from an uninterrupted run's at the first step after the
resume. Each step's loss goes to ``guard.extra["loss"]`` (keyed by step), where rehearse finds it.
"""

from __future__ import annotations

import sys
import time

import torch

import spotguard


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)  # the bug: not tracked, so a resume restarts the data
    guard = spotguard.Guard(every_steps=10, providers="auto", interval=0.1)
    guard.track(model=model, optimizer=opt)
    step = guard.resume()
    with guard:
        while step < 60:
            x = torch.randn(16, 8, generator=data)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            guard.extra.setdefault("loss", {})[str(step)] = loss.item()
            time.sleep(0.03)
            if guard.step(step):
                return spotguard.EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
