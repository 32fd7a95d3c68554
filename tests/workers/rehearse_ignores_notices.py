"""A job that makes steps (the heartbeat) but watches no notice and checkpoints nothing: a rehearsal
must see it killed at the deadline with its work lost. No torch: it starts in a fraction of a second."""

from __future__ import annotations

import sys
import time

from spotguard import heartbeat


def main() -> int:
    beat = heartbeat.attach()
    for step in range(1, 61):
        time.sleep(0.04)
        beat[0] = step
    return 0


if __name__ == "__main__":
    sys.exit(main())
