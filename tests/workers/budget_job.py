"""One periodic save of a ~192 MB state, printing how much the RSS grew during it at most (a test's worker).

argv: root, staging budget in bytes or "none". The RSS is sampled every 2 ms during the save, against
its value just before (the process's high-water mark may come from an earlier, unrelated peak).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

import spotguard


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak(threading.Thread):
    """The highest RSS seen while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.high, self.done = rss(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.002):
            self.high = max(self.high, rss())


def main() -> None:
    root, budget = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(4 << 20)) for i in range(12)})
    g = spotguard.Guard(
        root,
        providers=[],
        every_steps=1,
        keep=2,
        save_on_exit=False,
        staging_budget=None if budget == "none" else int(budget),
    )
    g.track(model=model)
    g.resume()
    before, peak = rss(), Peak()
    peak.start()
    with g:
        g.step(1)
        g.wait()
    peak.done.set()
    peak.join()
    st = g.stats()
    print(
        json.dumps(
            {
                "grew": max(peak.high, rss()) - before,
                "state": sum(p.numel() * 4 for p in model.values()),
                "budget": st.staging_budget,
                "staged": st.state_bytes,
                "checkpoints": st.checkpoints,
            }
        )
    )


if __name__ == "__main__":
    main()
