"""The checkpoints of one Guard: which save is in flight, what is committed, what failed.

``Saves`` drives a checkpoint engine (``spotguard.checkpoint.single`` or ``sharded``) for the
Guard: a periodic save is staged (the only part the loop waits for) and written by a
``PendingSave`` thread, or written at once; a due save that finds the previous one still in flight
is skipped or waits (``BusyPolicy``). Every commit is measured into ``GuardStats`` and announced
as a ``checkpoint`` event; failures are kept and raised by ``wait()``, never lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from spotguard import heartbeat
from spotguard.checkpoint.engine import Commit, Engine, Resumed, Tracked
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.state.budget import pinned_bytes
from spotguard.errors import LeaseLostError, NoLoadableCheckpointError, UnloadableStateError
from spotguard.events import Events
from spotguard.guard.emergency import CANCEL_GRACE_S
from spotguard.guard.options import BusyPolicy
from spotguard.guard.pending import PendingSave
from spotguard.guard.schedule import Schedule
from spotguard.guard.stats import GuardStats

if TYPE_CHECKING:
    from spotguard.coordination.agreement import Agreement

logger = logging.getLogger(__name__)


class Saves:
    """The save in flight and the newest committed steps of one Guard (its loop's thread drives it)."""

    #: The checkpoint engine, set by the Guard right after (it is given this object's ``committed``).
    engine: Engine
    #: The shortest notice of the clouds polled, (cloud, seconds), set by the Guard: a state that cannot
    #: commit within it at the measured rate is warned about once.
    notice_lead: tuple[str, float] | None = None
    _lead_warned = False
    #: Why this job lost the writer lease (set from the lease's thread): no save starts, one cut short failed.
    lost: str | None = None

    def __init__(
        self,
        tracked: Tracked,
        stats: GuardStats,
        events: Events,
        schedule: Schedule,
        busy: BusyPolicy,
        nice: int | None,
        activity: heartbeat.Activity | None = None,
    ) -> None:
        self.tracked, self.stats, self.events, self.schedule = tracked, stats, events, schedule
        self.busy, self.nice = busy, nice
        #: the heartbeat's ``SAVING`` mark, from a save's start to its end (what `spotguard rehearse` times)
        self.activity = activity or heartbeat.Activity()
        self.pending: PendingSave | None = None
        #: [distributed] a save dropped for an emergency one, whose thread may still be ending
        self.abandoned: PendingSave | None = None
        self.errors: list[BaseException] = []
        self.saved_step: int | None = None  # newest step committed or being written
        self.durable_step: int | None = None  # newest step committed to the durable storage
        self.last_saved: Manifest | None = None

    def committed(self, c: Commit) -> None:
        """The engine's ``on_commit``: from the loop's thread or the background writer's."""
        st = self.stats
        if c.synchronous:  # its own rate: what the emergency estimate uses
            st.record_sync(c.seconds, c.manifest.size)
        if not c.synchronous or c.manifest.reason in ("periodic", "advisory"):  # the periodic path's rate
            if c.uploaded:
                st.record_upload(c.seconds, c.manifest.size)
            else:
                st.record_write(c.seconds, c.manifest.size, work_s=c.work_s)
        self._check_notice_lead()
        self.last_saved = c.manifest
        if c.tier == "durable":
            self.durable_step = max(c.manifest.step, self.durable_step or 0)
            st.checkpoints += 1
        if self.events:  # the record carries the stats, so the JSON lines are a `plan --stats` file too
            m = c.manifest
            self.events.emit(
                "checkpoint",
                step=m.step,
                reason=m.reason,
                tier=c.tier,
                durable=c.tier == "durable",
                size=m.size,
                seconds=c.seconds,
                checkpoint_time=m.time,
                **st.as_dict(),
            )

    def _check_notice_lead(self) -> None:
        lead, st = self.notice_lead, self.stats
        if lead is None or self._lead_warned:
            return
        estimate = st.durable_seconds(two_tiers=self.engine.two_tiers)
        if estimate is None or estimate <= lead[1] or not st.state_bytes:
            return
        self._lead_warned = True
        logger.warning(
            "an emergency checkpoint of this state (%.2f GB) takes ~%.0fs at the measured %.0f MB/s, longer "
            "than %s's %.0fs notice: it would miss the deadline. Add a fast local tier (local_dir=, an "
            "instance NVMe) or a faster store, and checkpoint more often so that a missed one loses less",
            st.state_bytes / 1e9,
            estimate,
            st.state_bytes / estimate / 1e6,
            lead[0].upper(),
            lead[1],
        )

    def resume(self, fresh_ok: bool, release: Callable[[], None], where: str) -> Resumed | None:
        """The engine's resume (None: nothing to resume). One that raises calls ``release`` first (the writer
        lease back: this job does not start, the next may); ``fresh_ok`` (``on_unloadable="fresh"``): where
        checkpoints exist but none loads, a warning and None instead of ``NoLoadableCheckpointError``."""
        try:
            try:
                return self.engine.resume(self.tracked)
            except BaseException:
                release()
                raise
        except NoLoadableCheckpointError as e:
            if not fresh_ok:
                raise
            logger.warning(
                "no checkpoint in %s loads (%s); starting from step 0 (on_unloadable='fresh')",
                where,
                "; ".join(e.skipped),
            )
            return None

    def resumed(self, done: Resumed | None) -> None:
        """The engine restored ``done`` (None: nothing to resume): the next save is planned from its step."""
        if done is not None:
            self.saved_step, self.durable_step, self.last_saved = done.step, done.durable_step, done.manifest
            self.stats.restore_s = done.seconds
            self.schedule.after(done.step)
        m = done.manifest if done else None
        self.events.emit(
            "resume",
            step=done.step if done else 0,
            checkpoint=done.where if done else None,
            reason=m.reason if m else None,
            checkpoint_time=m.time if m else None,
            restore_s=done.seconds if done else None,
        )

    def due(self, step: int, reason: str, background: bool, agreement: Agreement | None) -> None:
        """A periodic or advisory save of ``step``: in the background (``background``) or at once. In a process
        group one save in flight on every rank or none: a rank whose previous one is still finishing decides."""
        if not background:
            self.save_logged(step, reason)
        elif agreement is None:
            self.start(step, reason)
        else:
            self.start(step, reason, busy=agreement.busy(self.in_flight() is not None))

    # -- synchronous ---------------------------------------------------------------------------
    def save(self, step: int, reason: str, deadline: float | None = None, final: bool = False) -> Manifest | None:
        """Write ``step`` now to the durable storage (None: committed already). Raises on failure."""
        t0 = time.monotonic()
        mark = self.activity.begin(heartbeat.SAVING, step)
        try:
            manifest = self.engine.save(self.tracked, step, reason, deadline=deadline, final=final)
        finally:
            self.activity.end(heartbeat.SAVING, mark)
        self.saved_step = step
        if manifest is not None and reason in ("periodic", "advisory"):
            self.schedule.observe(time.monotonic() - t0)  # a synchronous save stalls the loop for all of it
        self.schedule.after(step)  # after observe(): the next save is due at the re-picked interval
        return manifest

    def save_logged(self, step: int, reason: str, final: bool = False) -> None:
        """``save()``, a failure logged and kept (raised by ``wait()``): training goes on. Not after a state
        that no resume could load (``UnloadableStateError``): every later save would fail alike, so it is raised."""
        try:
            if final or self.saved_step != step:
                self.save(step, reason, final=final)
        except UnloadableStateError:
            raise
        except Exception as e:
            self.failed(step, reason, e)
            logger.error("%s checkpoint of step %d failed: %s: %s; training goes on", reason, step, type(e).__name__, e)
            self.schedule.after(step)

    def failed(self, step: int, reason: str, error: BaseException, keep: bool = True) -> None:
        self.stats.failures += 1
        if keep:
            self.errors.append(error)
        self.events.emit("failed", step=step, reason=reason, error=f"{type(error).__name__}: {error}")

    # -- in the background ---------------------------------------------------------------------
    def reserve(self) -> None:
        """Have the engine allocate the staging of periodic saves off the loop. Raises only a state that no
        resume could load (``UnloadableStateError``: the engine checks it here, once), as the first save would."""
        try:
            self.engine.reserve(self.tracked)
        except UnloadableStateError:
            raise
        except Exception as e:
            logger.warning(
                "cannot reserve the checkpoint staging (%s: %s); the first save allocates it", type(e).__name__, e
            )

    def start(self, step: int, reason: str, busy: bool | None = None) -> None:
        """Snapshot now, write in the background. ``busy``: whether the previous save is still in
        flight ([distributed] agreed by all ranks; by default this process's own view)."""
        pending = self.pending
        if busy is None:
            busy = pending is not None and not pending.done()
        if busy and self.busy is BusyPolicy.SKIP and self.lost is None:
            self._skip(step, reason, pending)
            return
        self.wait_pending()
        if self.lost is not None:  # also while this waited: nothing more of this run is written
            raise LeaseLostError(self.lost)
        t0 = time.perf_counter()
        activity = self.activity
        mark = activity.begin(heartbeat.SAVING, step)
        try:
            work = self.engine.stage(self.tracked, step, reason)
        except BaseException:
            activity.end(heartbeat.SAVING, mark)
            raise
        stall = time.perf_counter() - t0
        alloc = self.engine.alloc_s
        self.stats.record_snapshot(stall, self.engine.staged_bytes)
        self.stats.alloc_s = alloc
        budget = getattr(self.engine, "budget", None)
        self.stats.staging_budget = budget.limit if budget is not None else None
        self.stats.pinned_bytes = pinned_bytes()
        # With async saves the loop only loses the snapshot; a first one's allocation is not a steady cost.
        self.schedule.observe(max(stall - alloc, 0.0))
        self.saved_step = step

        def write(cancel: threading.Event) -> None:
            try:
                work(cancel)
            finally:  # the save is in flight until its thread ends, committed or not
                activity.end(heartbeat.SAVING, mark)

        self.pending = PendingSave(step, reason, write, nice=self.nice)
        self.schedule.after(step)

    def _skip(self, step: int, reason: str, pending: PendingSave | None) -> None:
        self.stats.skipped += 1
        if pending is not None:
            pending.skipped += 1
        in_flight = pending.step if pending is not None else None  # [distributed] None: another rank's
        what = in_flight if in_flight is not None else "?"
        if self.stats.skipped == 1:  # once per guard; later skips are only counted
            logger.warning(
                "%s checkpoint of step %d skipped: step %s is still being written (later skips are "
                'counted in guard.stats().skipped, not logged; busy="wait" waits instead)',
                reason,
                step,
                what,
            )
        else:
            logger.debug("%s checkpoint of step %d skipped: step %s is still being written", reason, step, what)
        self.events.emit("skipped", step=step, reason=reason, in_flight=in_flight)
        self.schedule.after(step)

    def in_flight(self) -> PendingSave | None:
        pending = self.pending
        return pending if pending is not None and not pending.done() else None

    def wait_pending(self, timeout: float | None = None) -> None:
        pending = self.pending
        if pending is None:
            return
        try:
            pending.wait(timeout)
        except Exception:
            pass  # already logged by the worker; kept by reap()
        self.reap()

    def reap(self) -> None:
        """Take the finished save in flight, keeping its error (an abandoned one's is only logged)."""
        pending = self.pending
        if pending is None or not pending.done():
            return
        self.pending = None
        if pending.error is not None:
            lost = self.lost
            if pending.cancelled and lost is None:
                logger.info("save of step %d was abandoned", pending.step)
            else:  # one stopped for a lost lease failed, as its commit would have
                self.failed(pending.step, pending.reason, LeaseLostError(lost) if lost else pending.error)
            if self.saved_step == pending.step:
                self.saved_step = None

    def abandon(self, grace: float) -> None:
        """Drop the save in flight (an emergency save took over); wait ``grace`` seconds for its thread."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.cancel()
        self.abandoned = pending
        try:
            pending.wait(grace)
        except Exception:
            pass  # abandoned: its error is no one's

    def finish(self, step: int | None, save: bool, final: bool, destroyed: bool, collective: bool) -> None:
        """The end of the run (``Guard.close``): settle the saves, write the final checkpoint of ``step``.

        ``final``: a final checkpoint is wanted (in a process group, only of a step without one).
        ``destroyed``: the program destroyed the process
        group inside the block (no collective can run, so a wanted final checkpoint is not written
        and a warning says so; a background save in flight still ends, as it coordinates through
        the store). ``collective``: saves are sharded; they are
        never replaced, and a save in flight that was abandoned is given time to end on all ranks.
        """
        self.engine.close()  # a reservation still waiting for peers gives up
        pending = self.pending
        if pending is not None and pending.cancelled and self.lost is None:  # abandoned for an emergency save
            if collective:
                self.abandon(CANCEL_GRACE_S * 5)  # its ranks drop it together, soon: let its thread end
            else:
                self.pending = None
        self.wait_pending()  # a background save needs no group: one in flight commits (or fails for real)
        if destroyed:
            if final:  # after a stop or an error none was wanted
                logger.warning(
                    "no final checkpoint of step %s: the process group was destroyed before the guard was "
                    "closed (call dist.destroy_process_group() after the `with guard:` block)",
                    step,
                )
        elif final and step is not None and not (collective and step == self.durable_step):
            # Single process: always, since the loop may have changed the state after its last guard.step()
            # (a scheduler stepped at the end of an epoch, guard.extra). An unchanged state is not written
            # twice; a changed one replaces the checkpoint of its step. Sharded saves are never replaced.
            if collective and self.saved_step == step:
                self.saved_step = None  # committed only to the local tier: write it durably now
            self.save_logged(step, "final", final=not collective)
        if save:
            self.wait()
        elif self.errors:
            logger.error("%d checkpoint error(s) during this run; the first: %s", len(self.errors), self.errors[0])

    def wait(self) -> None:
        """Block until every pending save is committed; raise the first background error, if any."""
        self.wait_pending()
        if self.errors:
            first, self.errors = self.errors[0], []
            raise first
