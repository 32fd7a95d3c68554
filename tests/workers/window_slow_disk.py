"""Worker for tests/guard/test_window.py: a second notice-window checkpoint that cannot finish in time.

``python window_slow_disk.py ROOT OUT_DIR``: trains a small model with ``deadline_policy="use-window"``
and the notice file of ``$SPOTGUARD_NOTICE_FILE``. Its disk is fast until the notice window opens,
then every file write takes minutes (a disk that degrades as the machine is being reclaimed), so the
second checkpoint is still being written when the test kills the process at the deadline. It reports
each step it finishes and where the window opened (``results-0.jsonl``).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from spotguard import Guard
from spotguard.storage import LocalStorage
from tests.workers.results import emit


class DegradingDisk(LocalStorage):
    slow = False

    @contextmanager
    def open_write(self, key, *, deadline=None):
        with super().open_write(key, deadline=deadline) as f:
            yield f
            if self.slow:
                time.sleep(600)  # the bytes are out, the file never closes: the save cannot commit

    def put_file(self, key, path, *, deadline=None):
        super().put_file(key, path, deadline=deadline)
        if self.slow:
            time.sleep(600)


def main() -> int:
    root, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    disk = DegradingDisk(root)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(disk, providers="file", interval=0.1, deadline_policy="use-window", save_on_exit=False)
    guard.track(model=model, optimizer=opt)

    def on_event(rec: dict) -> None:
        if rec["event"] == "window":
            emit(out, window=rec["step"], reserve_s=rec["reserve_s"])
            disk.slow = True

    guard.events.add(on_event)
    with guard:
        for step in range(1, 100_000):
            loss = model(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.05)
            emit(out, step=step)
            if guard.step(step):
                return 75
    return 0


if __name__ == "__main__":
    sys.exit(main())
