"""A Guard loop whose emergency checkpoint takes a while, for the stop-signal tests of `spotguard run`.

Run as ``python slow_emergency.py SECONDS``: the state is a 16 MB tensor written to the storage plus
an object whose snapshot takes SECONDS (as a large state does to write), so signals can arrive while
the save runs. Prints ``ready`` once training, ``saving`` when the emergency snapshot starts.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import spotguard


class SlowToSave:
    """Tracked state whose ``state_dict()`` takes ``seconds`` once armed (a time.sleep loop: signals
    are handled in between, as they are while a real save writes)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.armed = seconds, False

    def state_dict(self) -> dict[str, Any]:
        if self.armed:
            print("saving", flush=True)
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                time.sleep(0.02)
        return {"seconds": self.seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    slow = SlowToSave(float(sys.argv[1]))
    weights = torch.zeros(4 << 20)
    guard = spotguard.Guard(every_steps=None, providers="signal", interval=0.05, save_on_exit=False)
    start = guard.track(weights=weights, slow=slow).resume()
    with guard:
        for step in range(start + 1, 1_000_000):
            weights += 1
            time.sleep(0.01)
            if step == 3:
                slow.armed = True
                print("ready", flush=True)
            if guard.step(step):
                print(f"stopped at step {step}", flush=True)
                sys.exit(spotguard.EXIT_PREEMPTED)  # as the README's loop does, committed or not


if __name__ == "__main__":
    main()
