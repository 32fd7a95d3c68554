"""Threads that capture the RNG streams at once never deadlock (in-process ranks staging together did).

Two threads in ``torch.get_rng_state()`` at once can deadlock: one holds the generator's mutex while it
waits for the GIL (a garbage collection inside the call ran Python code), the other holds the GIL while it
waits for the mutex. ``state.capture_rng`` lets one thread in at a time. Run in a process of its own: a
deadlock holds the GIL, which no timeout inside the process could then interrupt.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import WORKERS, subprocess_env


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
@pytest.mark.timeout(120)
def test_four_threads_capturing_the_rng_streams_at_once_finish():
    try:
        done = subprocess.run(
            [sys.executable, str(WORKERS / "rng_threads.py"), "3"],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("threads capturing the RNG streams at once deadlocked")
    assert done.returncode == 0 and done.stdout.startswith("done "), done.stderr[-3000:]
