"""Worker for tests/metrics/test_distributed.py (run by torchrun): every rank exports its own metrics.

Rank N serves on ``port + LOCAL_RANK`` and writes ``{rank}`` of the JSON lines name filled in; each
rank scrapes its own endpoint after two sharded checkpoints and writes what it got to ``out-RANK.txt``.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import torch.distributed as dist
from torch import nn

from spotguard import Guard


def main() -> int:
    root, port, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(8, 4)
    guard = Guard(
        root,
        every_steps=2,
        providers=[],
        metrics_port=port,
        busy="wait",
        metrics_file=str(out / "metrics-{rank}.jsonl"),
    ).track(model=model)
    guard.resume()
    with guard:
        for step in range(1, 5):
            guard.step(step)
        guard.wait()  # periodic sharded saves are written in the background
        with urllib.request.urlopen(f"http://127.0.0.1:{guard.metrics.port}/metrics", timeout=10) as answer:
            (out / f"out-{rank}.txt").write_text(f"{guard.metrics.port}\n" + answer.read().decode())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
