"""A checkpoint being written in the background: done(), wait(), cancel(), and its error kept.

The worker is a daemon thread: a process that exits mid-write leaves an incomplete checkpoint
directory, which readers ignore (the manifest is written last). Exceptions are never lost: they
are logged when they happen and re-raised by ``wait()`` (as torchsnapshot's PendingSnapshot does).

On Linux the worker can run at a lower CPU priority (``nice``). Serialising and writing a large
state is mostly CPU work in the kernel (page-cache copies); on a machine whose cores the training
loop keeps busy, a worker at normal priority takes a core from torch's intra-op threads and every
step waits for the slowest one. At a higher niceness the worker runs in the loop's idle moments.
Threads it starts (hashing, upload pools) inherit the niceness.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from spotguard.errors import SaveCancelled

logger = logging.getLogger(__name__)


class PendingSave:
    """Runs ``work(cancel_event)`` in a background thread for checkpoint ``step``."""

    def __init__(
        self, step: int, reason: str, work: Callable[[threading.Event], None], nice: int | None = None
    ) -> None:
        self.step, self.reason = step, reason
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self.skipped = 0  # due checkpoints skipped while this one was in flight
        self._cancel = threading.Event()
        self._work = work
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name=f"spotguard-save-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        try:
            self._work(self._cancel)
        except SaveCancelled as e:
            self.error = e
            logger.info("background save of step %d abandoned", self.step)
        except BaseException as e:  # kept and re-raised by wait(); never lost
            self.error = e
            logger.error(
                "background %s checkpoint of step %d failed: %s: %s; training goes on",
                self.reason,
                self.step,
                type(e).__name__,
                e,
            )
        finally:
            if self.error is not None:
                # The kept error keeps its file and line, not the frames' locals: those hold the staged
                # tensors and, in a process group, the writer's gloo group, whose threads would outlive
                # Guard.close() (in a reference cycle through this frame) until a gc pass ran.
                traceback.clear_frames(self.error.__traceback__)
            self.finished = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def committed(self) -> bool:
        return self.done() and self.error is None

    def cancel(self) -> None:
        """Ask the worker to stop before its next file or the manifest (the commit never happens)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (True) or ``timeout`` passes (False). Raises the worker's error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None and not isinstance(self.error, SaveCancelled):
            raise self.error
        return True


def lower_priority(nice: int) -> bool:
    """Raise the calling thread's niceness by ``nice`` (Linux only; elsewhere it would renice the
    whole process). Returns whether it did. Unprivileged threads can lower, never raise, priority."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        logger.debug("could not lower the background writer's priority: %s", e)
        return False
    return True
