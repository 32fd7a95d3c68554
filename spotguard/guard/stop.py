"""What a stop does: settle the save in flight, then write the emergency checkpoint before the deadline.

``GuardStops`` is the Guard's side of a stop, in the order of the stop protocol (``coordination.stopping``):
the first stop's emergency checkpoint (``Emergency``), maybe a notice window after it
(``deadline_policy="use-window"``: ``WindowPolicy``), and the second stop at the window's end.
``emergency.decide`` says what to do with a periodic save still being written (in a process
group all ranks take the most cautious decision, since their parts are one collective save);
this module carries it out with the guard's ``Saves`` and reports the outcome. Failures are
logged and kept on the guard (``emergency_error``), never raised into the training loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spotguard.coordination.agreement import NOTHING, PERIODIC
from spotguard.guard.emergency import CANCEL_GRACE_S, EMERGENCY_FLOOR_S, FIT, Inflight, decide, time_given
from spotguard.guard.pending import PendingSave
from spotguard.guard.saves import Saves
from spotguard.notices.base import Notice

if TYPE_CHECKING:
    from spotguard.coordination.agreement import Agreement
    from spotguard.coordination.stopping import StopProtocol
    from spotguard.guard.insync import InStep
    from spotguard.watcher import Watcher

logger = logging.getLogger(__name__)


@dataclass
class Emergency:
    """One stop at ``step``: ``run()`` once. ``agree`` ([distributed]) makes a decision every rank's."""

    saves: Saves
    protocol: StopProtocol
    step: int
    notice: Notice | None
    acknowledge: Callable[[Notice], None]
    agree: Callable[[int], int] | None = None
    error: BaseException | None = None
    #: After ``run()``: the stop left a committed resume point, the stop step's checkpoint or (when it
    #: could not fit) the save that was in flight; what the job tells ``spotguard run`` (``heartbeat``).
    committed: bool = False
    #: Seconds the emergency save itself took (None: none was written)
    save_s: float | None = None
    outcome: dict[str, Any] = field(default_factory=dict)  # what run() did, for the stop/window event

    def estimate(self) -> float | None:
        """Seconds to write the state straight to the durable tier, from its measured throughput."""
        return self.saves.stats.durable_seconds(two_tiers=self.saves.engine.two_tiers)

    def rest(self, pending: PendingSave) -> float | None:
        """Estimated seconds until the in-flight save commits (None: not measured yet)."""
        st = self.saves.stats
        expected = (
            st.write_s
            if not self.saves.engine.two_tiers
            else (None if st.write_s is None or st.upload_s is None else st.write_s + st.upload_s)
        )
        return None if expected is None else max(expected - (time.monotonic() - pending.started), 0.0)

    def run(self, left: float | None) -> None:
        """``left``: seconds to the deadline ([distributed] the earliest of all ranks; None: the notice's).
        Ends with ``outcome`` saying what was committed, whatever happened, for the event the guard emits."""
        t0 = time.monotonic()
        try:
            self._run(left)
        finally:
            n, resume_at = self.notice, self.saves.durable_step
            self.committed = self.committed or resume_at == self.step
            self.outcome = dict(
                step=self.step,
                committed=resume_at == self.step,
                resume_step=resume_at,
                lost_steps=self.step - (resume_at or 0),
                seconds=time.monotonic() - t0,
                kind=n.kind if n else None,
                provider=n.provider if n else None,
            )

    def emit(self, event: str, **more: Any) -> None:
        """Announce what ``run()`` did: ``stop`` (training ends here) or ``window`` (it goes on)."""
        self.saves.events.emit(event, **self.outcome, **more)

    def _run(self, left: float | None) -> None:
        saves, step = self.saves, self.step
        if left is None and self.notice is not None:
            left = self.notice.seconds_left()
        if left is not None and left < EMERGENCY_FLOOR_S:
            logger.warning(
                "the notice leaves %.1fs; the emergency checkpoint gets %.0fs, best effort", left, EMERGENCY_FLOOR_S
            )
        left = time_given(left)
        t0 = time.monotonic()
        deadline = None if left is None else t0 + left
        pending = saves.in_flight()
        decision = (
            Inflight.NONE if pending is None else decide(pending.step, step, left, self.estimate(), self.rest(pending))
        )
        if self.agree is not None:  # one collective save in flight: one decision for all ranks
            decision = Inflight(self.agree(decision))
        if decision is Inflight.SAME:
            logger.warning("stop at step %d: its checkpoint is already being written; waiting for it", step)
            saves.wait_pending(left)
            if pending is not None and pending.committed:
                self._report(t0, left)
                return
            if pending is not None and saves.in_flight() is pending:  # still writing this step's folder
                pending.cancel()
                saves.wait_pending(CANCEL_GRACE_S)
                if saves.in_flight() is pending:  # two writers in one folder could mix their files
                    logger.error("stop at step %d: its save is still writing it; not writing it a second time", step)
                    return
        elif decision is Inflight.KEEP and pending is None:
            return  # [distributed] this rank's part is done, another's is finishing: it is the resume point
        elif decision is not Inflight.NONE and pending is not None and not self._settle(pending, deadline, decision):
            return  # the in-flight save is the resume point: the emergency one cannot make it
        saves.reap()
        if saves.saved_step == step and saves.durable_step == step:
            logger.warning("stop at step %d: already checkpointed", step)
            if self.notice:
                self.acknowledge(self.notice)
            return
        self._write(t0, left, deadline)

    def _write(self, t0: float, left: float | None, deadline: float | None) -> None:
        saves, step = self.saves, self.step
        estimate, size = self.estimate(), saves.stats.state_bytes
        left_now = None if deadline is None else deadline - time.monotonic()
        kept = saves.durable_step
        logger.warning(
            "emergency checkpoint of step %d: %s, estimated %s, %s; until it commits the resume point is %s",
            step,
            f"{size / 1e6:.0f} MB" if size else "size unknown",
            f"{estimate:.1f}s" if estimate is not None else "time unknown (no save measured yet)",
            f"{left_now:.1f}s before the deadline" if left_now is not None else "no deadline known",
            f"step {kept}" if kept is not None else "the start (nothing committed)",
        )
        if saves.saved_step == step:
            saves.saved_step = None  # committed to the local tier only: write it durably now

        def write() -> None:
            try:
                saves.save(step, "emergency", deadline=deadline)
            except Exception as e:
                saves.failed(step, "emergency", e, keep=False)
                raise

        self.error, self.save_s = self.protocol.write(step, write, lambda: saves.durable_step)
        if self.error is not None:
            return
        saves.stats.emergency_s = time.monotonic() - t0
        self._report(t0, left)

    def _settle(self, pending: PendingSave, deadline: float | None, decision: Inflight) -> bool:
        """Carry out ``decision`` on the in-flight save; False when it stays the resume point instead
        of an emergency checkpoint. A save still running at the deadline is abandoned."""

        def left() -> float:
            return 0.0 if deadline is None else max(deadline - time.monotonic(), 0.0)

        saves, step = self.saves, self.step
        fresh, rest = self.estimate() or 0.0, self.rest(pending)
        if decision is Inflight.WAIT:
            logger.warning(
                "stop at step %d: the save of step %d commits in ~%.1fs; waiting for it first",
                step,
                pending.step,
                rest or 0.0,
            )
            saves.wait_pending(max(left() * FIT - fresh, 0.0))  # never into the emergency save's share
            if saves.pending is None:
                return True
        elif decision is Inflight.KEEP:
            logger.error(
                "emergency checkpoint of step %d needs ~%.1fs but %.1fs are left: finishing the "
                "save of step %d instead (%s, %d step(s) will be lost)",
                step,
                fresh,
                left(),
                pending.step,
                "time unknown" if rest is None else f"~{rest:.1f}s",
                step - pending.step,
            )
            saves.wait_pending(left())
            if saves.pending is not None:
                pending.cancel()  # missed the deadline too: never hold the exit for it
            self.committed = pending.committed  # the resume point this stop chose
            return False
        # The worker stops at its next file or before its manifest; never wait long for that,
        # its leftovers are swept by a later run.
        logger.warning("stop at step %d: abandoning the save of step %d for the newer state", step, pending.step)
        pending.cancel()
        saves.wait_pending(CANCEL_GRACE_S if deadline is None else min(CANCEL_GRACE_S, left() / 10))
        return True

    def _report(self, t0: float, left: float | None) -> None:
        took = time.monotonic() - t0
        tail = "" if left is None else f", T-{left - took:.1f}s before the deadline"
        logger.warning("emergency checkpoint of step %d committed in %.2fs%s", self.step, took, tail)
        if self.notice:
            self.acknowledge(self.notice)  # e.g. Azure: approve the eviction, our state is safe


class GuardStops:
    """The Guard's stops: ``stop(step)`` on a stop verdict. ``agreement``: the ranks' vote (None in one
    process; the Guard sets a new one when entered again after ``close()``); ``in_step``: sources polled
    from ``step()`` (Ray's drain), or None."""

    def __init__(
        self,
        saves: Saves,
        protocol: StopProtocol,
        watcher: Watcher,
        agreement: Agreement | None,
        in_step: InStep | None,
    ) -> None:
        self.saves = saves
        self.protocol = protocol
        self.windowing = protocol.windowing
        self.watcher = watcher
        self.agreement = agreement
        self.in_step = in_step
        #: The step training stopped at for a notice, or None (also while training on in the notice window).
        self.stopped_at: int | None = None

    def vote(self, step: int) -> int:
        """[distributed] The verdict of sync step ``step``, the same on every rank (hence the same stop step):
        the most urgent of every rank's own; in the notice window, the second stop when any rank's clock
        calls it."""
        s, window = self.saves.schedule, self.windowing.window
        code = self.protocol.verdict(self.watcher.preempted.is_set(), s.advisory)
        if code == NOTHING and window is None and s.is_due(step):
            code = PERIODIC
        dist, sources = self.agreement, self.in_step  # with in-step sources (Ray's drain) the vote polls them
        return dist.vote(code) if sources is None else sources.vote(dist, code, step, window is not None)  # type: ignore

    def stop(self, step: int) -> bool:
        """A stop verdict at ``step``; True: training stops here (its emergency checkpoint is written)."""
        if self.stopped_at is not None:
            return True
        window = self.windowing.window
        if window is None:
            return self._first(step)
        if self.agreement is None and not window.closing():  # in a process group the vote said so already
            return False
        self.windowing.end()
        self.stopped_at = step
        self._emergency(step, window.left(), [], first_step=window.first_step)
        return True

    def _first(self, step: int) -> bool:
        """The emergency checkpoint, before the earliest deadline of all ranks; with ``"use-window"``
        maybe a notice window after it (``spotguard.coordination.window``). True: stop now."""
        self.stopped_at = step
        if self.in_step is not None:  # Ray's drain and the machine's notice: the earliest deadline governs
            self.in_step.at_stop(step)
        left, peer = self.protocol.stopped(step, self.agreement, self.watcher.notice)  # the flag, the vote
        if peer is not None:  # another rank saw it: make this rank's guard say so too
            self.watcher.report(peer)
        if not self.windowing.wanted:
            self._emergency(step, left, [])
            return True
        deadline = None if left is None else time.monotonic() + left
        held: list[Notice] = []  # acknowledged after the last checkpoint (Azure evicts once approved)
        stop = self._emergency(step, left, held, emit=False)
        committed = stop.error is None and self.saves.durable_step == step
        measured = stop.save_s if stop.save_s is not None else stop.estimate()
        if self.windowing.open(step, deadline, measured if committed else None, self.agreement) is None:
            stop.emit("stop")
            self.protocol.finish(held)  # the lease back, then the cloud told
            return True
        self.stopped_at = None
        stop.emit("window", **self.windowing.describe())
        return False

    def _emergency(
        self, step: int, left: float | None, held: list[Notice], emit: bool = True, **more: Any
    ) -> Emergency:
        """The stop's checkpoint of ``step``; its notices go to ``held``, acknowledged (after the lease is
        given back: Azure evicts once approved) here when ``emit`` (the stop's last checkpoint), else by
        the caller."""
        stop = Emergency(
            self.saves,
            self.protocol,
            step,
            self.watcher.notice,
            held.append,
            self.agreement.agree_inflight if self.agreement is not None else None,
        )
        try:
            stop.run(left)
        finally:
            # the window's end ("first_step"): the first checkpoint stands, whatever happens here
            self.protocol.record(stop.error, stop.committed, second="first_step" in more)
            if emit:  # the last checkpoint of this stop
                stop.emit("stop", **more)
                self.protocol.finish(held)
        return stop
