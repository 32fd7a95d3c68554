"""How long the calling thread has waited for a CPU: what a background write's wall time owes to a busy loop.

A periodic save's writer runs niced beside the training loop. After each write the disk completes, the
writer thread is runnable again but waits for a core the loop holds (on our 2-core CI machine 0.13-0.16 s
of a 0.4 GB file's 0.38-0.48 s of writing). An emergency save runs with the loop stopped and waits for
none, so its estimate (``GuardStats.durable_seconds``) must not count that wait. Linux says it per
thread in ``schedstat`` (nanoseconds on a run queue); elsewhere it is unknown and nothing is subtracted.
"""

from __future__ import annotations

import os

_SCHEDSTAT = "/proc/thread-self/schedstat"  # "<ns on a CPU> <ns runnable, waiting for one> <timeslices>"


def waited() -> float | None:
    """Seconds this thread has spent runnable but without a CPU since it started; None where unknown."""
    try:
        fd = os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 128).split()
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(fields[1]) / 1e9
    except (IndexError, ValueError):
        return None


class WaitClock:
    """Sums the CPU wait of the spans it is ``start``-ed and ``stop``-ped around, on the thread running each."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def start(self) -> float | None:
        return waited()

    def stop(self, started: float | None) -> None:
        if started is not None and (now := waited()) is not None:
            self.seconds += max(0.0, now - started)
