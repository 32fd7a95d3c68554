"""The training loop's face: track the state, resume it, and checkpoint at the right steps.

Order of use: ``Guard(...)`` -> ``track(...)`` -> ``resume()`` -> ``with guard:`` (starts the
watcher) -> ``guard.step(n)`` after every completed step -> leaving the block waits for pending
saves and writes a final checkpoint. ``step()`` is the hot path: when nothing is due it does one
flag check and one or two comparisons.

The Guard only decides and records: ``Schedule`` says when a save is due, ``Saves`` drives the
checkpoint engine (one process: ``checkpoint.single``; a process group: ``checkpoint.sharded``,
with the ``Agreement`` voting so that every rank acts at the same step), ``stop.GuardStops``
carries a stop out (the emergency checkpoint before the deadline, the notice window).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from spotguard import _env, checkpoint, heartbeat, planner
from spotguard.checkpoint.engine import Tracked
from spotguard.checkpoint.folders.tier import open_tier
from spotguard.checkpoint.state import data, state
from spotguard.coordination import agreement, lease, ranks
from spotguard.coordination.agreement import ADVISORY, NOTHING, PERIODIC, STOP
from spotguard.coordination.evaluation import Evaluation
from spotguard.coordination.options import Unloadable
from spotguard.coordination.stopping import StopProtocol
from spotguard.coordination.window import Window, WindowPolicy
from spotguard.errors import LeaseLostError
from spotguard.events import Events
from spotguard.guard import buckets, insync
from spotguard.guard.forward import Forward
from spotguard.guard.options import BusyPolicy, GuardOptions
from spotguard.guard.saves import Saves
from spotguard.guard.schedule import Schedule
from spotguard.guard.stats import GuardStats
from spotguard.guard.stop import GuardStops
from spotguard.notices.base import Notice
from spotguard.storage import Storage, open_storage
from spotguard.watcher import Watcher
from spotguard.weakcall import weakly

if TYPE_CHECKING:
    from spotguard.checkpoint.format.manifest import CheckpointInfo, Manifest
    from spotguard.metrics import GuardMetrics

logger = logging.getLogger(__name__)


class Guard:
    """Checkpoints a training loop periodically and on a notice, and resumes it exactly.

    ``storage`` is a path, ``file://``, ``s3://bucket/prefix``, ``gs://bucket/prefix`` or
    ``az://container/prefix`` URL (or a ``Storage``); when None it is read from
    ``$SPOTGUARD_STORAGE``. The options (``every_steps``, ``every_seconds``, ``keep``,
    ``providers``, ``local_dir`` ...) are those of ``GuardOptions``, by keyword.
    """

    @heartbeat.marking  # a bad option or URL: `spotguard run` exits 78, it does not restart into it
    def __init__(self, storage: str | Storage | None = None, **options: Any) -> None:
        self.options = o = GuardOptions.from_kwargs(options)
        #: ``deadline_policy="use-window"``: the notice window training goes on in, after the first stop
        self.windowing = WindowPolicy(o.deadline_policy, o.window_margin)
        self.storage: Storage = open_storage(_env.storage_or_env(storage))
        #: The rank vote, in an initialised process group (where saves are collective and sharded).
        self.agreement = agreement.setup(o.sync_every, async_save=o.background_sharded, same=self.windowing.settings())
        # $SPOTGUARD_LOCAL_DIR too, if this run's (tier.py); sharded saves have no local tier: not claimed
        self.local: Storage | None = None if self.agreement is not None else open_tier(o.local_dir, self.storage)
        providers = ranks.providers_for_rank(o.providers, o.poll_on)
        # sigint: Ctrl-C, or `spotguard run` forwarding one, stops with a checkpoint, not KeyboardInterrupt
        notice, advisory = weakly(self._on_notice), bool(o.stop_on_advisory)  # weakly: no cycle (weakcall.py)
        self.watcher = Watcher(providers, o.interval, on_notice=notice, stop_on_advisory=advisory, sigint=o.sigint)
        self.preempted = self.watcher.preempted
        #: Sources polled from step() where the ranks synchronise (Ray's drain), or None
        self.in_step = insync.InStep.of(self.watcher.providers, o.interval, self.watcher.report, bool(self.agreement))
        #: JSON-serialisable values saved in each checkpoint's manifest (as they are when the step is
        #: saved) and restored by ``resume()``: an epoch counter, an experiment tracker's run id.
        self.extra: dict[str, Any] = {}
        #: What this guard did (checkpoint, skipped, failed, notice, resume, stop, close), for listeners
        #: such as ``spotguard.metrics``; ``guard.events.add(fn)`` to hear them too.
        self.events = Events()
        self._tracked = Tracked({}, self.extra, untracked=o.untracked)
        self._beat = heartbeat.Beat()  # shared with `spotguard run` when $SPOTGUARD_HEARTBEAT is set
        #: the heartbeat's marks of a save in flight and of ``evaluation()`` (never written by step())
        self._activity = self._beat.activity
        self._stats = GuardStats(
            async_save=o.async_save if self.agreement is None else self.agreement.store is not None
        )
        self.schedule = Schedule(o.every_steps, o.every_seconds, o.mtbf_hours, self._stats)
        self.saves = Saves(
            self._tracked,
            self._stats,
            self.events,
            self.schedule,
            BusyPolicy(o.busy),
            o.background_nice,
            self._activity,
        )
        #: The run's writer lease (``coordination.lease``): taken before anything is loaded or written; its
        #: fence goes to the engine, which calls it before each manifest.
        self.lease = lease.WriterLease(self.storage, o.lease_ttl, bool(o.takeover), self.agreement, self)
        self.saves.engine = checkpoint.make_engine(
            self.storage,
            self.local,
            self.agreement,
            o.keep,
            weakly(self.saves.committed),
            o.async_save,
            o.reshard,
            o.rebatch,
            o.staging_budget,
            self.lease.fence,
        )
        self.saves.notice_lead = planner.notice_lead(self.watcher.providers)
        self._step: int | None = None
        self._start = 0  # the resumed step: a step() of it (after an evaluation before training) trained nothing
        self._reserve_due = o.async_save if self.agreement is None else self.agreement.store is not None  # staging
        self._unwatched = True  # until entered: a step() then warns once that no notice is watched
        #: The stop protocol (``coordination.stopping``), shared with every trainer integration.
        self.protocol = StopProtocol(self._beat, self.windowing, self.lease.release, self.watcher.acknowledge)
        #: The Guard's stops (``guard.stop``): the emergency checkpoint, the notice window, the second stop.
        self.stops = GuardStops(self.saves, self.protocol, self.watcher, self.agreement, self.in_step)
        self.metrics: GuardMetrics | None = None
        if o.metrics_port is not None or o.metrics_file:  # [metrics] reads stats() and events; step() is untouched
            from spotguard import metrics

            self.metrics = metrics.export(
                self, port=o.metrics_port, host=o.metrics_host, jsonl=o.metrics_file, per_rank=True
            )

    def place(self) -> ranks.Place:
        """This process's rank, local rank and world size (what the metrics label their figures with)."""
        return ranks.place()

    window: Forward[Window | None] = Forward(
        "windowing.window", 'The open notice window (``deadline_policy="use-window"``, after the first stop), or None.'
    )
    stopped_at: Forward[int | None] = Forward(
        "stops.stopped_at",
        "The step training stopped at for a notice, or None (also while training on in the notice window).",
    )
    notice: Forward[Notice | None] = Forward("watcher.notice", "The notice that caused the stop, or None.")
    emergency_error: Forward[BaseException | None] = Forward(
        "protocol.emergency_error",
        "Why the stop's (first) emergency checkpoint was not committed; None when it was (or no stop yet).",
    )
    window_error: Forward[BaseException | None] = Forward(
        "protocol.window_error",
        '``"use-window"``: why the second checkpoint, at the window\'s end, was not committed; the first '
        "stays the resume point (``emergency_error`` None), and the job still exits 75.",
    )
    last_saved: Forward[Manifest | None] = Forward(
        "saves.last_saved", "The manifest of the newest checkpoint this guard wrote or resumed, or None."
    )

    @property
    def last_step(self) -> int | None:
        """The step last passed to ``step()`` (or resumed from); None before either."""
        return self._step

    def track(self, **objects: Any) -> Guard:
        """Register the training state under stable names: objects with ``state_dict()`` and
        ``load_state_dict()``, tensors, dicts and lists (restored in place), ``spotguard.Value`` holders."""
        for name, obj in objects.items():
            if not data.warn_if_plain_loader(name, obj):
                self._tracked.objects[name] = state.trackable(name, obj)
        return self

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint in durable storage (manifest checked, contents not), or None."""
        return checkpoint.latest(self.storage)

    def stats(self) -> GuardStats:
        """Measured figures: snapshot stall, write and upload throughput, state size."""
        return self._stats

    def resume(self) -> int:
        """Restore the newest checkpoint that verifies, from either tier; return its step (0 if none).

        A checkpoint that fails verification is skipped with a warning naming the reason, and the
        previous one is tried; when checkpoints exist but none loads, ``NoLoadableCheckpointError``
        (``on_unloadable="fresh"``: a warning, and 0). A valid checkpoint that does not fit the
        tracked objects (or a tracked data loader: ``data.check_loaders``) raises.
        In a process group it is collective: every rank restores the same step, and a tracked DDP
        model's gradient buckets are pinned first (``pin_ddp_buckets``; see ``guard.buckets``).
        """
        if self.agreement is not None:
            self.agreement.check()
        self._hold_lease()
        if self.agreement is not None:
            if self.options.pin_ddp_buckets is not False:  # before any step, in fresh and resumed runs alike
                buckets.pin(self._tracked.objects.values(), always=bool(self.options.pin_ddp_buckets))
        fresh_ok = Unloadable(self.options.on_unloadable) is Unloadable.FRESH
        with self._beat.marks():  # NoLoadableCheckpointError too, unless fresh_ok
            done = self.saves.resume(fresh_ok, self.lease.release, self.storage.describe())
        if done is not None:
            self.extra.clear()
            self.extra.update(done.manifest.extra)
            self._step = self._start = done.step
        self.saves.resumed(done)
        return done.step if done else 0

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        """Call after each completed step. Saves when due; True means stop (checkpoint committed)."""
        self._beat.step(step)
        self._step = step
        if self._unwatched:
            self._unwatched = False
            logger.warning("guard.step() outside `with guard:`: no notice or signal is watched, no preemption caught")
        if self._reserve_due and step > self._start:  # after a training step: an optimizer has made its state
            self._reserve_due = False
            with self._beat.marks():  # a state no resume could load is refused here, at the first step
                self.saves.reserve()
        if self.agreement is not None:
            return self._vote(step)
        if self.in_step is not None:  # Ray's drain, on this process's clock
            self.in_step.tick(step)
        s = self.schedule
        if self.preempted.is_set() or step >= s.due_step or (s.timed and time.monotonic() >= s.due_time):
            return self._act(STOP if self.preempted.is_set() else ADVISORY if s.advisory else PERIODIC, step)
        return False

    def evaluation(self) -> Evaluation:
        """Mark an evaluation run after training step ``last_step``; leave it when ``should_stop()`` says so.

        ::

            with guard.evaluation() as ev:
                for batch in val_loader:
                    if ev.should_stop():
                        break
                    ...
            if guard.step(step):   # the same step again: stops after a notice, else nearly free
                sys.exit(spotguard.EXIT_PREEMPTED)

        The emergency checkpoint of that step then holds the RNG streams as the evaluation found them
        and each loader as at its last batch: the resumed run evaluates again from the start with the
        same random draws, as the uninterrupted run did. Call ``step()`` right after the block, before
        the loop's end-of-epoch code changes anything (``guard.extra``, a scheduler).
        """
        stopping = lambda: self.preempted.is_set() and self.window is None  # noqa: E731
        return Evaluation(self._tracked, self._step, stopping, self.agreement, self._activity)

    def _vote(self, step: int) -> bool:
        """[distributed] The same verdict, hence the same step, on every rank (on sync steps only)."""
        if self.stopped_at is not None:
            return True
        if step % self.options.sync_every:
            return False
        verdict = self.stops.vote(step)
        return verdict != NOTHING and self._act(verdict, step)

    def _act(self, verdict: int, step: int) -> bool:
        if verdict == STOP:
            return self.stops.stop(step)
        if self.lease.lost is not None and self.agreement is None:  # another job took the run over
            self._beat.lease_held()
            raise LeaseLostError(self.lease.lost)
        reason = "advisory" if verdict == ADVISORY else "periodic"
        dist = self.agreement
        background = self.options.async_save if dist is None else dist.store is not None
        with self._beat.marks():  # a state no resume could load (the first save checks it), another writer
            self.saves.due(step, reason, background, dist)
        return False

    def _hold_lease(self) -> None:
        """Take the run's writer lease before anything is loaded or written; ``LeaseHeldError`` (and the
        heartbeat flag: ``spotguard run`` exits 73, no restart) while another job holds it."""
        with self._beat.marks():
            self.lease.hold()

    def _lease_lost(self, why: str) -> None:
        """From the lease's thread (or a fence): another job took the run over. The next ``step()`` raises, no
        save starts, and one of this process alone stops writing (else its files could land over the new holder's)."""
        self._beat.lease_held()
        self.schedule.due_step, self.saves.lost = 0, why  # step() takes its slow path, where _act raises
        if (pending := self.saves.in_flight()) is not None and self.agreement is None:
            pending.cancel()

    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        """Write a checkpoint of the current state as ``step`` now, synchronously, to the durable URL.

        Returns None when ``step`` is already committed. The global RNG streams are left exactly as
        they were, whatever the storage libraries draw while writing.
        """
        if self.saves.saved_step == step:
            return None
        if self.agreement is not None:
            self.agreement.check()
        self._hold_lease()
        with self._beat.marks():
            return self.saves.save(step, reason, deadline)

    def wait(self) -> None:
        """Block until every pending save is committed; raise the first background error, if any."""
        self.saves.wait()

    def _on_notice(self, notice: Notice) -> None:
        self._stats.notices[notice.kind] = self._stats.notices.get(notice.kind, 0) + 1
        self.events.emit("notice", **{k: v for k, v in notice.to_json().items() if k != "raw"})
        if self.windowing.cut(notice, bool(self.options.stop_on_advisory)):
            pass  # in the notice window: a later stop notice brings its deadline forward
        elif notice.advisory and not self.options.stop_on_advisory and self.options.checkpoint_on_advisory:
            self.schedule.early()  # the next step() checkpoints early (from the loop's thread)

    # -- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> Guard:
        if self.agreement is not None and self.agreement.group is None and ranks.is_distributed():
            # entered again after close(): collective too
            self.agreement = agreement.setup(
                self.options.sync_every, async_save=self.options.background_sharded, same=self.windowing.settings()
            )
            self.saves.engine.groups = self.agreement  # type: ignore[attr-defined]
            self.lease.agreement = self.stops.agreement = self.agreement
            self.saves.abandoned = None  # an abandoned writer ends on its own: it polls the store and its cancel
        self._hold_lease()  # before the watcher starts: a refused job leaves nothing running
        if self.metrics is not None:
            self.metrics.reopen()  # closed by the previous block's close(): this block is exported too
        self.watcher.start()
        self.schedule.start()
        self._unwatched = False
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(save=exc_type is None)

    def close(self, save: bool = True) -> None:
        """Finish pending saves, checkpoint the last step after a clean finish, then stop the watcher.

        A notice or Ctrl-C during the final checkpoint is recorded, never acted on. The first error of a
        background save is raised here after a clean finish. In a process group the guard's own gloo
        groups are destroyed last, whatever happened (``Agreement.close``). Calling it again is harmless.
        """
        dist, saves = self.agreement, self.saves
        try:
            destroyed = dist is not None and dist.group is not None and not dist.usable
            # Wanted also where the program destroyed the group: finish() then says it cannot be written.
            final = (
                save
                and self.options.save_on_exit
                and self.stopped_at is None
                and (dist is None or dist.group is not None)
            )
            try:
                with self._beat.marks():
                    saves.finish(self._step, save, final, destroyed, collective=dist is not None)
            finally:
                self.lease.release()  # clean exit or not, this guard writes nothing more: the next job starts at once
        finally:
            try:
                self.watcher.stop()  # restores the signal handlers (SIGINT included) and stops polling
            finally:
                try:
                    if dist is not None:
                        dist.close()
                finally:
                    self.events.emit("close", step=self._step, stopped_at=self.stopped_at)  # metrics pause on it
