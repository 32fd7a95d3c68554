"""Worker for tests/guard/test_distributed.py (run by torchrun, 2 ranks): storage that fails on rank 1 only.

Steps 1 and 2 are saved normally. Then, case by case, rank 1's storage refuses one key with a
``StorageError`` (as a flaky network does on one node) or one of its tracked objects cannot give its
state; rank 0's storage works. At last, with nothing failing, step 2 resumes. Each rank reports ``{case, kind, seconds, message}`` per case (``kind`` the error type, or ``ok`` and the result)
to ``results-<rank>.jsonl`` beside the checkpoint root: every rank must fail together and at once, none may
wait in a collective for the others.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from spotguard import Guard
from spotguard.errors import StorageError
from spotguard.storage import LocalStorage
from tests.workers.results import emit


class FlakyStorage(LocalStorage):
    """Local storage whose reads and writes of the keys in ``failing`` raise ``StorageError``."""

    failing: set[str] = set()

    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[Any]:
        if key in self.failing:
            raise StorageError(f"injected: cannot write {key}")
        with super().open_write(key, deadline=deadline) as f:
            yield f

    def put_file(self, key: str, path: Path, *, deadline: float | None = None, crc: Any = None) -> None:
        if key in self.failing:
            raise StorageError(f"injected: cannot write {key}")
        super().put_file(key, path, deadline=deadline, crc=crc)

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        if key in self.failing:
            raise StorageError(f"injected: cannot read {key}")
        with super().local_copy(key) as path:
            yield path


class Counter:
    """A tracked object whose state cannot be taken while ``broken``."""

    def __init__(self) -> None:
        self.n, self.broken = 0, False

    def state_dict(self) -> dict[str, int]:
        if self.broken:
            raise RuntimeError("injected: no state")
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def main() -> int:
    storage = FlakyStorage(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, counter = nn.Linear(4, 2), Counter()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = Guard(storage, providers=None).track(model=model, optimizer=opt, counter=counter)
    for step in (1, 2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        guard.save(step)

    def resume() -> int:
        return Guard(storage, providers=None).track(model=model, optimizer=opt, counter=counter).resume()

    def attempt(case: str, fn: Callable[[], Any], *failing: str, broken: bool = False) -> None:
        storage.failing = set(failing) if rank == 1 else set()
        counter.broken = rank == 1 and broken
        t0 = time.monotonic()
        try:
            kind, result = "ok", fn()
        except (Exception, CheckpointException) as e:
            kind, result = type(e).__name__, str(e).replace("\n", " ")
        emit(Path(sys.argv[1]).parent, case=case, kind=kind, seconds=time.monotonic() - t0, message=str(result))

    attempt("save-state", lambda: guard.save(3), broken=True)
    attempt("save-shard", lambda: guard.save(4), "step-00000004/shards/rank-00001.distcp")
    attempt("load-rank-file", resume, "step-00000002/rank-00001.pt")
    attempt("load-metadata", resume, "step-00000002/shards/metadata.dcp")
    attempt("load-shard", resume, *(f"step-00000002/shards/rank-0000{r}.distcp" for r in (0, 1)))
    attempt("load-after-all", resume)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
