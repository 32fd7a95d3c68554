"""Worker for tests/checkpoint/state/test_rng_threads.py: threads capturing the RNG streams at once.

Each of 4 threads calls ``state.capture_rng()`` in a loop for ``SECONDS`` while cyclic garbage with a
finalizer that lets the GIL go makes the collector hand the GIL over inside torch's C calls. Prints
``done N`` and exits 0; a deadlock leaves it hanging (the test's timeout kills it).
"""

from __future__ import annotations

import gc
import sys
import threading
import time

from spotguard.checkpoint.state.state import capture_rng


class Cycle:
    def __del__(self) -> None:
        time.sleep(0)  # lets the GIL go: another thread runs while this one is inside torch's call


def main(seconds: float) -> None:
    gc.set_threshold(10, 1, 1)
    stop = time.monotonic() + seconds
    done = [0] * 4

    def work(i: int) -> None:
        while time.monotonic() < stop:
            capture_rng()
            c = Cycle()
            c.self = c  # type: ignore[attr-defined]
            del c
            done[i] += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", sum(done), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
