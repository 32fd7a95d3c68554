"""The stop protocol, written once for the ``Guard`` and every trainer integration.

What a stop does, in this order (the saving itself is the caller's: ``stop.Emergency`` for the
Guard, the trainer's own save for an integration):

0. ``verdict(stop, advisory)``: this rank's own verdict of a step, which the ranks then vote on
   (``Agreement.vote``: the most urgent of all); in the notice window, the second stop on this
   rank's clock.
1. ``stopped(step, agreement, notice)``: the heartbeat says "stopped for a notice", so ``spotguard
   run`` does not restart the job; [distributed] every rank stops after the same step, under the
   earliest deadline of all ranks (``Agreement.agree_stop``, collective).
2. The emergency checkpoint is written (``write``: timed, its failure logged with what it costs), then
   ``record(error, committed, second)``: the heartbeat's
   "committed" flag (``spotguard run`` exits 75 only then; the first commit stands), and why it was
   not committed, as ``emergency_error`` (or, for the notice window's second checkpoint,
   ``window_error``: the first stays the resume point).
3. With ``deadline_policy="use-window"`` the first stop may open a notice window
   (``WindowPolicy.open``): training goes on, and steps 2-4 come again at the window's end.
4. ``finish(notices)`` after the stop's last checkpoint: the writer lease is given back (nothing
   more is written: the replacement machine takes it at once), then, last, the cloud is told
   (Azure approves the eviction and may take the machine at once).

``saved`` is steps 2-4 for an integration, whose trainer has written the checkpoint of ``step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from spotguard import heartbeat
from spotguard.guard.agreement import ADVISORY, NOTHING, STOP
from spotguard.notices.base import Notice

if TYPE_CHECKING:
    from spotguard.guard.agreement import Agreement
    from spotguard.guard.window import WindowPolicy

logger = logging.getLogger(__name__)


class StopProtocol:
    """One job's stops: the heartbeat's flags, the outcome, the lease and the cloud, in order.

    ``beat``: the heartbeat shared with ``spotguard run`` (``heartbeat.Beat``); ``release``: gives
    the writer lease back (None: no lease); ``acknowledge``: tells the cloud (``Watcher.acknowledge``).
    """

    def __init__(
        self,
        beat: heartbeat.Beat,
        windowing: WindowPolicy,
        release: Callable[[], None] | None,
        acknowledge: Callable[[Notice], None],
    ) -> None:
        self.beat = beat
        self.windowing = windowing
        self.release = release
        self.acknowledge = acknowledge
        #: Why the stop's (first) emergency checkpoint was not committed; None when it was (or no stop yet).
        self.emergency_error: BaseException | None = None
        #: ``"use-window"``: why the second checkpoint was not committed (the first stays the resume point).
        self.window_error: BaseException | None = None

    def verdict(self, stop: bool, advisory: bool, tick: bool = True) -> int:
        """This rank's own verdict of a step, before the ranks vote: ``STOP`` for a stop notice
        (``stop``), ``ADVISORY`` for an advisory to act on, else ``NOTHING``. In the notice window
        ``STOP`` once its second checkpoint is due by this rank's clock (``tick``: a training step
        ended here), else ``NOTHING``: no advisory or periodic checkpoint in the window."""
        window = self.windowing.window
        if window is not None:
            return STOP if window.closing(tick=tick) else NOTHING
        return STOP if stop else ADVISORY if advisory else NOTHING

    def stopped(
        self, step: int, agreement: Agreement | None, notice: Notice | None
    ) -> tuple[float | None, Notice | None]:
        """The first stop, at ``step``: (seconds to the deadline, the notice another rank saw or None).

        First the heartbeat's flag (also where only another rank saw the notice: ``spotguard run``
        does not restart), then, [distributed], collectively, the earliest deadline of all ranks; in
        one process ``notice``'s."""
        self.beat.stopped()
        if agreement is None:
            return (None if notice is None else notice.seconds_left()), None
        left, peer = agreement.agree_stop(step, notice)
        if peer is not None:
            logger.warning("rank %d: another rank saw a notice: stopping after step %d with it", agreement.rank, step)
        return left, peer

    def write(
        self, step: int, write: Callable[[], object], resume_step: Callable[[], int | None]
    ) -> tuple[BaseException | None, float | None]:
        """Write the stop's checkpoint of ``step`` (``write()`` raises when it is not committed): (None,
        seconds it took) or (the error, None), logged with the resume point that stays (``resume_step()``,
        asked after the failure) and the steps lost. Never raises: the stop goes on either way."""
        t0 = time.monotonic()
        try:
            write()
        except Exception as e:
            kept = resume_step()
            logger.error(
                "emergency checkpoint of step %d NOT committed (%s: %s); the resume point stays %s, %d step(s) lost",
                step,
                type(e).__name__,
                e,
                "the start" if kept is None else f"step {kept}",
                step - (kept or 0),
            )
            return e, None
        return None, time.monotonic() - t0

    def record(self, error: BaseException | None, committed: bool, second: bool = False) -> None:
        """The outcome of a stop's checkpoint (``second``: the notice window's, at its end)."""
        if committed:
            self.beat.committed()  # `spotguard run` exits 75 only then; the first commit stands
        if second:
            self.window_error = error  # whatever happens, the first checkpoint stands
        else:
            self.emergency_error = error

    def finish(self, notices: Iterable[Notice]) -> None:
        """After the stop's last checkpoint: the lease back, then, last, each of ``notices`` acknowledged."""
        if self.release is not None:
            self.release()  # nothing more is written: the replacement machine takes the lease at once
        for notice in notices:
            # e.g. Azure: approve the eviction, the state is safe. Last: the machine may go at once then.
            self.acknowledge(notice)

    def saved(
        self,
        step: int,
        error: BaseException | None,
        save_s: float | None,
        deadline: Callable[[], float | None],
        agreement: Agreement | None,
        notice: Notice | None,
        may_train_on: bool = True,
    ) -> bool:
        """An integration's stop checkpoint of ``step``, committed (``error`` None) or not; True: train on
        in the notice window. ``deadline()``: the monotonic deadline; ``notice``: acknowledged when committed."""
        spent = self.windowing.end()
        self.record(error, error is None, second=spent is not None)
        if spent is not None:
            if error is not None:
                logger.error(
                    "the second checkpoint of the notice window (step %d) is NOT committed: the resume point "
                    "stays the first, step %d",
                    step,
                    spent.first_step,
                )
        elif may_train_on and self.windowing.open(step, deadline(), save_s if error is None else None, agreement):
            return True  # the cloud is told after the second checkpoint: Azure evicts once approved
        self.finish([notice] if error is None and notice is not None else [])
        return False
