"""A Guard loop prepared by Accelerate, for `spotguard run -- accelerate launch ...` (tests/ops/test_launchers.py).

One process (``accelerate launch --cpu``) or a process group (``--multi_gpu --num_processes 2`` on
CPU: gloo); the storage comes from ``$SPOTGUARD_STORAGE``. Each rank appends ``{step, loss}`` to
``OUT/losses-<rank>.jsonl`` and exits 75 after a stop.

    python tests/workers/accelerate_guard.py OUT --steps 40 --step-sleep 0.05
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

import spotguard


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches, restored on resume
    guard = spotguard.Guard(every_steps=None, providers="signal", interval=0.1)
    guard.track(model=model, optimizer=opt, data=data)
    step = start = guard.resume()
    print(f"[rank {rank}] {accelerator.num_processes} process(es), starting at step {start}", flush=True)
    log = open(Path(args.out) / f"losses-{rank}.jsonl", "a")
    with guard:
        while step < args.steps:
            x = torch.randn(4, 8, generator=data)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            step += 1
            log.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            log.flush()
            time.sleep(args.step_sleep)
            if guard.step(step):
                print(f"[rank {rank}] stopped at step {step}", flush=True)
                return spotguard.EXIT_PREEMPTED
    print(f"[rank {rank}] finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
