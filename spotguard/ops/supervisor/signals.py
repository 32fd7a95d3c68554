"""Our stop signals, forwarded to the job once: the job writes its emergency checkpoint, we wait.

A repeat of the same signal within ``DUPLICATE_WINDOW`` of the previous one is the same broadcast
(Slurm and systemd's control-group mode signal every process, a wrapper shell may forward too, an
agent may repeat it every 0.1 s) and is not forwarded again; only a repeat after a quiet
``DUPLICATE_WINDOW`` is (the child's Guard then stops at once). The window counts from the latest
signal, not the first: a storm that lasts longer than the window never becomes "stop now" and so
never kills a job in the middle of its emergency checkpoint. ``forward_as`` (e.g. SIGUSR1) keeps
our delivery distinct from the platform's own where it signals the child directly as well.
The signal goes to the job's topmost processes (``procs.Job.signal_top``): the launcher while it
runs (torchrun, ``deepspeed``'s per-node launcher pass it on to the ranks), then whatever it left
running when it exited (``accelerate launch`` in one process dies of SIGTERM before its trainer).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

from .options import signame
from .procs import Job

logger = logging.getLogger("spotguard.ops.supervisor")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: A repeat of the stop signal this soon after the previous one is the same broadcast, not a user insisting.
DUPLICATE_WINDOW = 2.0


class Forwarder:
    """Catches SIGTERM/SIGINT/SIGUSR1 while installed and forwards them to the running child.

    Handlers run in the main thread between bytecodes, so ``attach()`` (after ``Popen`` returns)
    and ``on_signal()`` never race: a signal that came while the child was being started is
    forwarded by ``attach()``, once.
    """

    def __init__(self, grace: float, forward_as: int | None = None) -> None:
        self.grace, self.forward_as = grace, forward_as
        self.stopping = threading.Event()
        self.signal: int | None = None  # the first stop signal
        self.at = 0.0  # its monotonic time
        self.latest = 0.0  # the monotonic time of the latest one, duplicates included
        self.duplicates = 0  # repeats not forwarded
        self._job: Job | None = None
        self._unforwarded: int | None = None
        self._previous: dict[int, object] = {}
        #: After a stop, ``restore()`` ignores the stop signals instead of giving them back: for a process
        #: that exits right after the run (``spotguard run``), not for a library caller.
        self.hold_after_stop = False

    @property
    def job(self) -> Job | None:
        """The attempt being watched, None between attempts."""
        return self._job

    @property
    def forwarded(self) -> int | None:
        """The signal the job is sent for our first stop signal (``forward_as`` or that one)."""
        return self.forward_as or self.signal

    def attach(self, job: Job) -> None:
        self._job = job
        sig, self._unforwarded = self._unforwarded, None
        if sig is not None:
            job.signal_top(sig)

    def detach(self) -> None:
        self._job = None

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        now = time.monotonic()
        previous, self.latest = self.latest, now
        if self.stopping.is_set() and signum == self.signal and now - previous < DUPLICATE_WINDOW:
            self.duplicates += 1
            if self.duplicates == 1:  # a storm would fill the log: the first repeat says it for all
                logger.info(
                    "%s again within %.0fs: the same stop, not forwarded (nor any repeat less than %.0fs apart)",
                    signame(signum),
                    DUPLICATE_WINDOW,
                    DUPLICATE_WINDOW,
                )
            return
        again = self.stopping.is_set()  # a repeat after a quiet duplicate window: the sender insists
        if not again:
            self.signal, self.at = signum, now
            logger.warning(
                "%s received: forwarding it to the job and waiting up to %.0fs for its checkpoint",
                signame(signum),
                self.grace,
            )
            self.stopping.set()
        job, sig = self._job, self.forward_as or signum
        if job is None:
            self._unforwarded = sig  # a child being started gets it from attach()
        else:
            job.signal_top(sig, again)  # a second delivery means "now" to the child's Guard too

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: stop signals are not forwarded")
            return
        self._previous = {sig: signal.signal(sig, self.on_signal) for sig in FORWARDED}

    def restore(self) -> None:
        """Give the stop signals back; with ``hold_after_stop``, after a stop, ignore them instead: the run
        ends for that stop, and a repeat of it (a storm) arriving while the process exits would kill it
        (-15) before it exits with the code the stop decided (75 for a committed checkpoint)."""
        hold = self.hold_after_stop and self.signal is not None
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if hold else handler)  # type: ignore[arg-type]
        self._previous = {}

    def stop_code(self, default: int = 0) -> int:
        """128 + the stop signal: what we exit with when a stop ends the run."""
        return 128 + (self.signal or default)
