"""Worker for tests/guard/test_distributed.py: the program destroys the process group inside the
``with guard:`` block while a background sharded save is still being written (rank 1 is slow).

Each rank trains 4 steps under DDP, every 3rd step due; rank 1's shard of step 3 takes ``SLOW``
seconds to open. After step 4 the program calls ``dist.destroy_process_group()`` inside the block.
Each rank appends to ``results-<rank>.jsonl`` how long ``guard.step(3)`` blocked the loop and how
long leaving the block took.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spotguard import Guard
from spotguard.storage import LocalStorage
from tests.workers.results import emit

SLOW = 3.0


class SlowShard(LocalStorage):
    def put_file(self, key, path, *, deadline=None, crc=None):
        if key.endswith("step-00000003/shards/rank-00001.distcp"):
            time.sleep(SLOW)
        return super().put_file(key, path, deadline=deadline, crc=crc)


def main() -> int:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = Guard(SlowShard(root), providers=None, every_steps=3, keep=5).track(model=model, optimizer=opt)
    blocked = {}
    with guard:
        for step in range(1, 5):
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t0 = time.monotonic()
            guard.step(step)
            blocked[step] = time.monotonic() - t0
        dist.destroy_process_group()  # inside the block: step 3 is still being written by rank 1
        t0 = time.monotonic()
    emit(out, step3_s=blocked[3], close_s=time.monotonic() - t0, background=guard.stats().async_save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
