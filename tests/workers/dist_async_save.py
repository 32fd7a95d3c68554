"""Worker for tests/guard/test_distributed.py (run by torchrun): async sharded saves under DDP, one rank slow.

Every step is due for a checkpoint; rank 1's storage takes ``SLOW`` seconds per file it writes,
so most due saves find the previous one still in flight, and rank 0's pruning after a commit
(a listing) is slow too, so that its writer thread outlives rank 1's: both ranks must still skip
or start the same saves. Each rank appends to ``results-<rank>.jsonl`` beside the checkpoint root: the steps it started,
how many it skipped, and its model state at each started step (for the test to compare with
what was committed), then resumes the newest checkpoint and prints whether it is exact. Last, a
byte of the newest checkpoint's rank-1 shard file (which rank 1 verifies for both, rank 0 reads
too) is flipped, and both ranks must resume the checkpoint before it.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from spotguard import Guard
from spotguard.storage import LocalStorage
from tests.workers.results import emit

SLOW = 0.15


class SlowStorage(LocalStorage):
    @contextmanager
    def open_write(self, key, *, deadline=None):
        if dist.get_rank() == 1:
            time.sleep(SLOW)
        with super().open_write(key, deadline=deadline) as f:
            yield f

    def put_file(self, key, path, *, deadline=None, crc=None):
        if dist.get_rank() == 1:
            time.sleep(SLOW)
        super().put_file(key, path, deadline=deadline, crc=crc)

    def list_sizes(self, prefix=""):
        if dist.get_rank() == 0 and prefix == "":  # the scan behind pruning, after the commit
            time.sleep(SLOW)
        return super().list_sizes(prefix)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main() -> int:
    root, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    guard = Guard(SlowStorage(root), providers=None, every_steps=1, keep=100, async_sharded=True).track(
        model=model, optimizer=opt
    )
    started, states = [], {}
    g = torch.Generator().manual_seed(rank)
    with guard:
        for step in range(1, steps + 1):
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            skipped = guard.stats().skipped
            guard.step(step)
            if guard.stats().skipped == skipped:  # every step is due: a save not skipped was started
                started.append(step)
                states[step] = flat(model)
            time.sleep(0.02)  # 40 steps outlast a save or two, even on a loaded machine
    final = guard.last_saved.step if guard.last_saved else None
    out = Path(root).parent
    emit(out, started=started, skipped=guard.stats().skipped, final=final, states=states)

    model2, opt2 = build()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    fresh = Guard(LocalStorage(root), providers=None).track(model=model2, optimizer=opt2)
    resumed = fresh.resume()
    emit(out, resumed=resumed, exact=flat(model2) == flat(model))

    shard = Path(root) / f"step-{resumed:08d}" / "shards" / "rank-00001.distcp"
    if rank == 0:
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        shard.write_bytes(bytes(raw))
    dist.barrier()
    again = Guard(LocalStorage(root), providers=None).track(model=model2, optimizer=opt2)
    emit(out, after_flip=again.resume())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
