"""runqueue: a niced writer's wait for a CPU is measured, and a file's own work leaves it out."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from spotguard.checkpoint.files.fileio import ALIGN, DirectFile
from spotguard.checkpoint.files.runqueue import waited
from spotguard.guard.pending import lower_priority

pytestmark = pytest.mark.skipif(waited() is None, reason="no per-thread schedstat (Linux only)")


@contextmanager
def busy_cores() -> Iterator[None]:
    """One spinning process per core and one more: a training loop that holds every CPU."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        time.sleep(0.3)  # the interpreters are up and spinning
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def niced(work):
    """``work()`` on a thread at the background writer's priority (threads it starts inherit it)."""
    out: list = []
    thread = threading.Thread(target=lambda: (lower_priority(19), out.append(work())))
    thread.start()
    thread.join(60)
    assert out, "the niced thread did not finish"
    return out[0]


def test_waited_grows_while_a_niced_thread_waits_behind_busy_cores():
    def spins() -> float:
        before, end = waited(), time.perf_counter() + 0.2
        while time.perf_counter() < end:
            sum(range(1000))  # always runnable: on busy cores mostly waiting for one
        return waited() - before

    with busy_cores():
        behind = niced(spins)
    assert behind > 0.1, behind  # of 0.2 s (alone on this machine: ~0; beside the other test worker it varies)


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
def test_a_file_written_beside_busy_cores_counts_its_disk_time_not_its_wait_for_a_cpu(tmp_path):
    """The emergency estimate's rate (``work_seconds``): a stopped loop leaves the writer a CPU."""

    def write() -> DirectFile:
        with DirectFile(tmp_path / "f", buffer_size=16 * ALIGN) as f:
            for _ in range(32):
                f.write(os.urandom(16 * ALIGN))
                time.sleep(0.001)  # the writer threads go idle and wake up again, as beside a loop
        return f

    with busy_cores():
        f = niced(write)
    assert f.cpu_wait.seconds > 0.02, f.cpu_wait.seconds
    assert f.cpu_wait.seconds < f.io_s
    assert f.work_seconds(0.0) == pytest.approx(max(f.io_s - f.cpu_wait.seconds, f.hash_s))
    assert f.work_seconds(0.0) < f.io_s - 0.02  # without the wait: the file's io time was mostly waiting
