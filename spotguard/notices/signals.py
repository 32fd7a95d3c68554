"""Signals as notices: SIGTERM (Kubernetes, shutdown scripts) and SIGUSR1 (Slurm ``--signal``).

The handler only records the signal and wakes the watcher through a ``SimpleQueue`` (safe to use
from a signal handler), so the training loop is interrupted for microseconds, never killed.
A second delivery of the same signal means "really stop now": the previous handler is restored
and the signal re-delivered, so a second SIGTERM terminates as usual and a second SIGINT gives
the usual KeyboardInterrupt. ``Guard`` adds SIGINT to whatever it watches (``cover_sigint``).
Only a repeat ``REPEAT_WINDOW`` seconds after the first delivery counts: one sooner is the same stop
delivered again (``torch.multiprocessing.spawn`` makes SIGINT each rank's parent-death signal, which
Linux may deliver twice, microseconds apart; systemd, Slurm and a wrapper may each signal too), and
taken for "stop now" it killed the rank before its emergency checkpoint. The window counts from the
first delivery, so pressing Ctrl-C again and again still gets out; and from when Python runs the
handler, not when the signal came: a repeat that arrives while the main thread is in a long C call
(a backward pass) is timed when that call returns. (``spotguard run`` forwards a signal once per
2 s storm: ``ops.supervisor.signals``.)
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from .base import Notice, NoticeProvider, Report, utcnow

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: A repeat of a signal this soon (s) after its first delivery is the same stop, not the sender insisting:
#: the duplicates seen come microseconds apart, a person's second Ctrl-C later than this.
REPEAT_WINDOW = 0.5


def _to_signal(sig: str | int | signal.Signals) -> signal.Signals:
    if isinstance(sig, str):
        name = sig.upper()
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    return signal.Signals(sig)


class SignalProvider(NoticeProvider):
    """Turns the first delivery of each configured signal into a ``signal`` notice.

    ``grace`` (seconds), when given, sets the notice deadline (e.g. a pod's
    terminationGracePeriodSeconds); without it the deadline is unknown. ``optional``: the signals
    were not asked for (``cover_sigint``), so outside the main thread, where no handler can be set,
    they are left as they are with one INFO line per process rather than a warning.
    """

    name = "signal"
    blocking = True

    def __init__(
        self,
        signals: Iterable[str | int | signal.Signals] = DEFAULT_SIGNALS,
        grace: float | None = None,
        wait: float = 0.5,
        *,
        optional: bool = False,
    ) -> None:
        self.signals = tuple(_to_signal(s) for s in signals)
        self.optional = optional
        self.grace = grace
        self.wait = wait
        self._queue: queue.SimpleQueue[Notice | None] = queue.SimpleQueue()
        self._previous: dict[signal.Signals, Any] = {}
        self._received: dict[signal.Signals, float] = {}  # each signal's first delivery (monotonic)
        self._calmed: tuple[Any, Any] | None = None  # (our SIGCHLD handler, torch's it wraps)
        self._worker_died = False  # a loader worker died after the stop: torch's handler would raise at any SIGCHLD

    def open(self, report: Report) -> None:
        if threading.current_thread() is not threading.main_thread():
            names = [s.name for s in self.signals]
            if not self.optional:
                logger.warning(
                    "signal handlers can only be installed from the main thread; signals %s will not be watched",
                    names,
                )
            elif not _told_off_main:
                _tell_off_main(names)
            return
        self._received.clear()  # a reopened provider starts afresh: its next signal is a first one
        for sig in self.signals:
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                logger.debug("SIGINT is ignored in this process (a background job); leaving it ignored")
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
            if callable(self._previous[sig]) and self._previous[sig] is not signal.default_int_handler:
                logger.info("%s already had a handler; it will be called after spotguard's", sig.name)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        previous = self._previous.get(sig, signal.SIG_DFL)
        now = time.monotonic()
        first = self._received.setdefault(sig, now)  # one call: a handler run inside this one sees it
        if first is not now and now - first < REPEAT_WINDOW:
            return  # the same stop, delivered again
        if first is not now:
            # A later delivery: the sender insists. Give the signal its previous meaning.
            signal.signal(sig, previous if previous not in (None, signal.SIG_IGN) else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(sig)
            return
        self._calm_loader_workers()
        at = utcnow()
        deadline = at + dt.timedelta(seconds=self.grace) if self.grace is not None else None
        self._queue.put(Notice("signal", "signal", deadline=deadline, received_at=at, raw={"signal": sig.name}))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def _calm_loader_workers(self) -> None:
        """A signal sent to the whole process group (``timeout``, Slurm, systemd's control group) also
        kills the data loader's workers (their own SIGTERM handler), and torch's SIGCHLD handler then raises
        "DataLoader worker ... is killed by signal" wherever the main thread is: in the step, or in the
        emergency save. From the stop on such a death is expected: logged, not raised. A loader used
        again still fails on its dead workers. Python runs pending handlers in signal-number order, so this
        (SIGTERM 15, SIGUSR1 10) comes before a SIGCHLD (17) that arrived with it."""
        torch_handler = signal.getsignal(signal.SIGCHLD)
        if self._calmed or getattr(torch_handler, "__module__", None) != "torch.utils.data._utils.signal_handling":
            return

        def calm(signum: int, frame: FrameType | None) -> None:
            try:
                torch_handler(signum, frame)  # type: ignore[misc,operator]
            except RuntimeError as e:
                self._worker_died = True
                logger.info("after the stop signal: %s", e)

        signal.signal(signal.SIGCHLD, calm)
        self._calmed = (calm, torch_handler)

    def poll(self) -> Notice | None:
        try:
            return self._queue.get(timeout=self.wait)
        except queue.Empty:
            return None

    def wakeup(self) -> None:
        self._queue.put(None)

    def close(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            if self._previous:
                logger.warning("signal handlers installed by spotguard can only be restored from the main thread")
            return
        for sig, previous in self._previous.items():
            # Leave alone a handler that someone installed after us.
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        # torch's handler back, unless a worker died: it stays registered (a loader's iterator outlives the
        # block), and torch's handler would raise again at every later SIGCHLD (a subprocess ending)
        if self._calmed is not None and not self._worker_died and signal.getsignal(signal.SIGCHLD) == self._calmed[0]:
            signal.signal(signal.SIGCHLD, self._calmed[1])
        self._calmed = None


_told_off_main = False


def _tell_off_main(names: list[str]) -> None:
    global _told_off_main
    _told_off_main = True
    logger.info(
        "guard entered outside the main thread: %s keep their usual meaning (Ctrl-C raises KeyboardInterrupt "
        "in the main thread), since signal handlers can only be set there",
        names,
    )


def cover_sigint(providers: list[NoticeProvider]) -> None:
    """Make SIGINT a stop notice too (Ctrl-C, or ``spotguard run`` forwarding one), unless a provider
    in ``providers`` already watches it. A second SIGINT raises ``KeyboardInterrupt`` as usual.
    A guard entered outside the main thread leaves SIGINT as it is (no handler can be set there)."""
    if not any(isinstance(p, SignalProvider) and signal.SIGINT in p.signals for p in providers):
        providers.append(SignalProvider(("SIGINT",), optional=True))
