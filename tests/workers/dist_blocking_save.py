"""Worker for tests/guard/test_distributed.py (run by torchrun): a rank that hangs in the middle of a save.

Step 1 is saved normally. During the save of step 2, rank 1's storage writes a marker file with its
pid and then blocks inside ``open_write`` of its own file, as a rank does while the machine dies
under it; the test kills that rank there.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spotguard import Guard
from spotguard.storage import LocalStorage


class HangingStorage(LocalStorage):
    def __init__(self, url: str, marker: Path) -> None:
        super().__init__(url)
        self.marker = marker

    def put_file(self, key, path, *, deadline=None, crc=None):
        if key == "step-00000002/rank-00001.pt":
            self.marker.write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        super().put_file(key, path, deadline=deadline, crc=crc)


def main() -> int:
    root, marker = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = Guard(HangingStorage(root, marker), providers=None).track(model=model, optimizer=opt)
    for step in (1, 2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        guard.save(step, "manual")
    return 0


if __name__ == "__main__":
    sys.exit(main())
