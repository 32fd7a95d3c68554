"""The training loop's face: track the state, resume it, and checkpoint at the right steps.

Order of use: ``Guard(...)`` -> ``track(...)`` -> ``resume()`` -> ``with guard:`` (starts the
watcher) -> ``guard.step(n)`` after every completed step -> leaving the block waits for pending
saves and writes a final checkpoint. ``step()`` is the hot path: when nothing is due it does one
flag check and one or two comparisons.

Periodic saves are asynchronous: ``step()`` copies the state into reused host buffers and returns;
a background thread serialises it, writes it to the first tier (``local_dir`` when given, else the
durable URL) and uploads it to the durable URL. Emergency saves are synchronous and go straight to
the durable URL, bounded by the notice deadline.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from spotguard import _env, checkpoint, heartbeat
from spotguard.checkpoint import data, state
from spotguard.checkpoint.manifest import CheckpointInfo, Manifest
from spotguard.checkpoint.snapshot import Staging, canonical
from spotguard.errors import CheckpointCorruptError, CheckpointExistsError, ConfigError
from spotguard.events import Events
from spotguard.guard import agreement, ranks
from spotguard.guard.options import BusyPolicy, GuardOptions
from spotguard.guard.pending import PendingSave
from spotguard.guard.stats import GuardStats
from spotguard.notices import signals
from spotguard.notices.base import Notice, NoticeProvider
from spotguard.planner import AdaptiveInterval
from spotguard.storage import Storage, open_storage
from spotguard.watcher import Watcher

if TYPE_CHECKING:
    from spotguard.metrics import GuardMetrics

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
FIT = 0.9  # share of the time left that an estimated save may use (estimates are rough)
CANCEL_GRACE_S = 1.0  # how long an emergency waits for an abandoned save to notice
DESTROYED_GRACE_S = 5.0  # how long close() waits for a save whose process group the program destroyed
#: An emergency save whose deadline has passed (a long step, a user's stale deadline) or is about to
#: still gets this long, best effort: the machine is still here, and "not started" loses the work.
#: Short enough not to distort a real short deadline (a pod's grace period); long enough for one
#: request (S3's shortest request timeout under a deadline is 5 s too).
EMERGENCY_FLOOR_S = 5.0


class Inflight(enum.IntEnum):
    """An emergency's decision on a periodic save in flight; ordered so that MAX is the most cautious."""

    NONE = 0  # nothing in flight
    SAME = 1  # the in-flight save is of the stop step itself: wait for it
    WAIT = 2  # both fit before the deadline: wait for it, then write the emergency checkpoint
    ABANDON = 3  # the newer state wins: cancel it, write the emergency checkpoint
    KEEP = 4  # the emergency checkpoint cannot fit: let it commit, it is the resume point


def _copy_extra(extra: dict[str, Any]) -> dict[str, Any]:
    try:
        return copy.deepcopy(extra)
    except Exception:  # not JSON anyway: checkpoint.write reports it from the background save
        return dict(extra)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Guard:
    """Checkpoints a training loop periodically and on a notice, and resumes it exactly.

    ``storage`` is a path, ``file://``, ``s3://bucket/prefix``, ``gs://bucket/prefix`` or ``az://container/prefix`` URL (or a
    ``Storage``); when None it is read from ``$SPOTGUARD_STORAGE``. ``local_dir`` (default
    ``$SPOTGUARD_LOCAL_DIR``) adds a fast first tier (e.g. the instance's NVMe) from which periodic
    checkpoints are uploaded in the background. ``stop_on_advisory`` (default
    ``$SPOTGUARD_STOP_ON_ADVISORY``, else False) stops on an advisory notice instead of only
    checkpointing early. ``metrics_port`` / ``metrics_file`` export the measured figures and events
    (``spotguard.metrics``; the port needs ``spotguard[metrics]``) without adding work to ``step()``.
    While the ``with`` block runs, the first SIGINT (Ctrl-C) is a stop notice like SIGTERM and a
    second one raises ``KeyboardInterrupt``; ``sigint=False`` keeps Python's default.
    """

    def __init__(
        self,
        storage: str | Storage | None = None,
        *,
        every_steps: int | None = None,
        every_seconds: float | str | None = None,
        keep: int = 3,
        providers: str | Iterable[str | NoticeProvider] | None = "auto",
        interval: float = 1.0,
        save_on_exit: bool = True,
        stop_on_advisory: bool | None = None,
        checkpoint_on_advisory: bool = True,
        local_dir: str | None = None,
        async_save: bool = True,
        busy: BusyPolicy | str = BusyPolicy.SKIP,
        mtbf_hours: float | None = None,
        background_nice: int | None = 10,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_file: str | None = None,
        sync_every: int = 1,
        poll_on: str = "local-rank-0",
        reshard: str = "refuse",
        sigint: bool = True,
        async_sharded: bool = False,
    ) -> None:
        if stop_on_advisory is None:  # not given: the job's environment decides (e.g. the terraform module)
            stop_on_advisory = _env.flag(_env.STOP_ON_ADVISORY, default=False)
        self.options = GuardOptions(every_steps, every_seconds, keep, providers, interval, save_on_exit,
                                    stop_on_advisory, checkpoint_on_advisory, local_dir, async_save, busy,
                                    mtbf_hours, background_nice, metrics_port, metrics_host, metrics_file,
                                    sync_every, poll_on, reshard, sigint, async_sharded=async_sharded)
        # every_seconds="auto": Young/Daly from the measured checkpoint cost, re-picked as it changes.
        self._adaptive = AdaptiveInterval(mtbf_hours) if every_seconds == "auto" and mtbf_hours else None
        if storage is None:
            storage = os.environ.get(_env.STORAGE)
            if not storage:
                raise ConfigError(f"no storage given: pass a URL or set ${_env.STORAGE}")
        self.storage: Storage = open_storage(storage)
        local_dir = local_dir or os.environ.get(_env.LOCAL_DIR)  # set by `spotguard run --local-dir`
        self.local: Storage | None = open_storage(local_dir) if local_dir else None
        # [distributed hook] per-rank providers; the agreement collective when in a process group.
        # In a group, saves are collective and sharded (spotguard.checkpoint.sharded).
        providers = ranks.providers_for_rank(providers, poll_on)
        self._dist = agreement.setup(sync_every, async_save=self.options.async_sharded)
        self.watcher = Watcher(providers, interval, on_notice=self._on_notice, stop_on_advisory=stop_on_advisory)
        if sigint:  # Ctrl-C, or `spotguard run` forwarding one: stop with a checkpoint, not KeyboardInterrupt
            signals.cover_sigint(self.watcher.providers)
        self.preempted = self.watcher.preempted
        #: JSON-serialisable values saved in each checkpoint's manifest (as they are when the step is
        #: saved) and restored by ``resume()``: an epoch counter, an experiment tracker's run id.
        self.extra: dict[str, Any] = {}
        self.stopped_at: int | None = None
        self.last_saved: Manifest | None = None
        self.emergency_error: BaseException | None = None
        self._stats = GuardStats(async_save=self.options.async_save if self._dist is None else self.options.async_sharded)
        self._staging = Staging()
        self._pending: PendingSave | None = None
        self._abandoned: PendingSave | None = None  # [distributed] a save dropped for an emergency one
        self._errors: list[BaseException] = []
        self._objects: dict[str, Any] = {}
        self._step: int | None = None
        self._saved_step: int | None = None  # newest step committed or being written
        self._durable_step: int | None = None  # newest step committed to the durable URL
        self._due_step: float = math.inf
        self._due_time: float = math.inf
        self._timed = every_seconds is not None
        self._lock = threading.Lock()
        self._beat = heartbeat.attach()  # shared with `spotguard run` when $SPOTGUARD_HEARTBEAT is set
        self._schedule(0)
        #: What this guard did (checkpoint, skipped, failed, notice, resume, stop, close), for listeners
        #: such as ``spotguard.metrics``; ``guard.events.add(fn)`` to hear them too.
        self.events = Events()
        self.metrics: GuardMetrics | None = None
        if metrics_port is not None or metrics_file:  # [metrics] reads stats() and events; step() is untouched
            from spotguard import metrics

            self.metrics = metrics.export(self, port=metrics_port, host=metrics_host, jsonl=metrics_file,
                                          per_rank=True)

    # -- setup -------------------------------------------------------------------------------
    @property
    def notice(self) -> Notice | None:
        """The notice that caused the stop, or None."""
        return self.watcher.notice

    def track(self, **objects: Any) -> Guard:
        """Register the training state under stable names: objects with ``state_dict()`` and
        ``load_state_dict()``, tensors, dicts and lists (restored in place), ``spotguard.Value`` holders."""
        for name, obj in objects.items():
            if data.warn_if_plain_loader(name, obj):
                continue
            self._objects[name] = state.trackable(name, obj)
        return self

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint in durable storage (manifest checked, contents not), or None."""
        return checkpoint.latest(self.storage)

    def stats(self) -> GuardStats:
        """Measured figures: snapshot stall, write and upload throughput, state size."""
        return self._stats

    @property
    def last_step(self) -> int | None:
        """The step last passed to ``step()`` (or resumed from); None before either."""
        return self._step

    def resume(self) -> int:
        """Restore the newest checkpoint that verifies, from either tier; return its step (0 if none).

        A checkpoint that fails verification is skipped with a warning naming the reason, and the
        previous one is tried. A valid checkpoint that does not fit the tracked objects raises.
        """
        if self._dist is not None:  # [distributed hook] collective, sharded checkpoints
            step = self._dist.resume(self)
            self._resumed(step, self.storage.describe(checkpoint.step_dir(step)) if step else None)
            return step
        tiers = [(s, checkpoint.scan(s)) for s in ([self.local] if self.local else []) + [self.storage]]
        durable = [i.step for i in tiers[-1][1] if i.complete]
        self._durable_step = durable[-1] if durable else None
        candidates = sorted(((i, s) for s, infos in tiers for i in infos), key=lambda c: c[0].step, reverse=True)
        for info, storage in candidates:  # same step: the local tier comes first (stable sort)
            where = storage.describe(info.name)
            if not info.complete:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                continue
            t0 = time.monotonic()
            try:
                payload = self._load(storage, info)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                continue
            self._restore(info, payload)
            self._stats.restore_s = time.monotonic() - t0
            m = info.manifest
            logger.info("resumed from step %d (%s, %s old) in %s", info.step, m.reason if m else "?",
                        checkpoint.human_duration(m.age_seconds() if m else None), where)
            self._drop_killed_saves(tiers, info.step)
            self._resumed(info.step, where)
            return info.step
        logger.info("no checkpoint in %s: starting from step 0", self.storage.describe())
        self._resumed(0, None)
        return 0

    def _resumed(self, step: int, where: str | None) -> None:
        m = self.last_saved if where else None
        self.events.emit("resume", step=step, checkpoint=where, reason=m.reason if m else None,
                         checkpoint_time=m.time if m else None, restore_s=self._stats.restore_s if m else None)

    @staticmethod
    def _drop_killed_saves(tiers: list[tuple[Storage, list[CheckpointInfo]]], resumed: int) -> None:
        """Delete incomplete ``step-N/`` older than the resume point: saves killed mid-write.

        Safe only here, before this run writes anything: the writer that left them is gone, and
        the run goes on past ``resumed``, so they would never be replaced. Corrupt ones are kept.
        """
        for storage, infos in tiers:
            for info in infos:
                if info.status == "incomplete" and info.step < resumed:
                    try:
                        checkpoint.delete(storage, info.name)
                        logger.info("removed %s: an unfinished save (%s)", storage.describe(info.name), info.problem)
                    except OSError as e:  # StorageError included: cleanup must never fail a resume
                        logger.warning("cannot remove unfinished save %s: %s", storage.describe(info.name), e)

    def _load(self, storage: Storage, info: CheckpointInfo) -> dict[str, Any]:
        from spotguard.checkpoint.sharded import refuse_sharded
        refuse_sharded(info)  # [distributed hook] a sharded checkpoint needs a process group
        with checkpoint.open_verified(storage, info, STATE_FILE) as path:
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: cannot be loaded safely ({e})") from e
        if not isinstance(payload, dict) or payload.get("step") != info.step or "objects" not in payload:
            raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: unexpected content")
        return payload

    def _restore(self, info: CheckpointInfo, payload: dict[str, Any]) -> None:
        state.restore(self._objects, payload["objects"], where=info.name)
        generators = payload.get("generators", {})
        for name, obj in self._objects.items():
            if data.is_stateful_loader(obj):
                data.restore_generator(obj, generators.get(name))
                data.neutralize_next_iterator(obj)
        self.extra.clear()
        self.extra.update(info.manifest.extra if info.manifest else {})
        state.restore_rng(payload["rng"])  # last: nothing after this may draw
        self._step = self._saved_step = info.step
        self.last_saved = info.manifest
        self._schedule(info.step)

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        """Call after each completed step. Saves when due; True means stop (checkpoint committed)."""
        self._beat[0] = step
        if self._dist is not None:  # [distributed hook] every rank gets the same verdict
            return self._dist.step(self, step)
        if self.preempted.is_set() or step >= self._due_step or (self._timed and time.monotonic() >= self._due_time):
            return self._step_slow(step)
        self._step = step
        return False

    def _step_slow(self, step: int) -> bool:
        self._step = step
        if self.preempted.is_set():
            if self.stopped_at is None:
                self.stopped_at = step
                self._emergency(step)
            return True
        reason = "advisory" if self._due_step == -math.inf else "periodic"
        if self.options.async_save:
            self._save_async(step, reason)
        else:
            self._save_logged(step, reason)
        return False

    def _payload(self, step: int, staged: bool) -> dict[str, Any]:
        objects = state.collect(self._objects)
        return canonical({  # the same state serialises to the same bytes (the final save compares them)
            "step": step,
            "rng": state.capture_rng(),
            "objects": self._staging.snapshot(objects) if staged else objects,
            "generators": {n: g for n, o in self._objects.items() if (g := data.generator_state(o)) is not None},
        })

    def _save_async(self, step: int, reason: str, busy: bool | None = None) -> None:
        """Snapshot now, write in the background. ``busy``: whether the previous save is still in
        flight ([distributed] agreed by all ranks; by default this process's own view)."""
        pending = self._pending
        if busy is None:
            busy = pending is not None and not pending.done()
        if busy:
            if self.options.busy is BusyPolicy.SKIP:
                self._stats.skipped += 1
                if pending is not None:
                    pending.skipped += 1
                in_flight = pending.step if pending is not None else None  # [distributed] another rank's
                if self._stats.skipped == 1:  # once per guard; later skips are only counted
                    logger.warning("%s checkpoint of step %d skipped: step %s is still being written (later "
                                   "skips are counted in guard.stats().skipped, not logged; busy=\"wait\" "
                                   "waits instead)", reason, step, in_flight if in_flight is not None else "?")
                else:
                    logger.debug("%s checkpoint of step %d skipped: step %s is still being written",
                                 reason, step, in_flight if in_flight is not None else "?")
                self.events.emit("skipped", step=step, reason=reason, in_flight=in_flight)
                self._schedule(step)
                return
            self._wait_pending()
        self._reap()
        t0 = time.perf_counter()
        if self._dist is not None:  # [distributed hook] this rank's shard and files, staged alike
            work = self._dist.stage(self, step, reason)
        else:
            with state.rng_isolated():  # collecting a loader's state may draw; leave no trace
                payload = self._payload(step, staged=True)
            extra = _copy_extra(self.extra)  # the values of this step, whatever the loop sets while it is written
            work = lambda cancel: self._write_tiers(step, reason, payload, extra, cancel)  # noqa: E731
        stall = time.perf_counter() - t0
        self._stats.record_snapshot(stall, self._staging.nbytes)
        if self._adaptive is not None:
            self._adaptive.observe(stall)  # with async saves the loop only loses the snapshot
        self._saved_step = step
        self._pending = PendingSave(step, reason, work, nice=self.options.background_nice)
        self._schedule(step)

    def _write_tiers(self, step: int, reason: str, payload: dict[str, Any], extra: dict[str, Any],
                     cancel: threading.Event) -> None:
        """Background: serialise to the first tier, then upload to the durable URL."""
        first = self.local or self.storage
        t0 = time.monotonic()
        manifest = self._write(first, step, reason, lambda f: torch.save(payload, f), cancel=cancel, extra=extra)
        if manifest is None:
            return
        took = time.monotonic() - t0
        self._stats.record_write(took, manifest.size)
        self._prune(first)
        if self.local is not None:
            self._committed(manifest, "local", took, durable=False)
            t1 = time.monotonic()
            info = CheckpointInfo(step, checkpoint.step_dir(step), "complete", manifest)
            try:
                checkpoint.copy(self.local, self.storage, info, cancel=cancel)
            except CheckpointExistsError:
                pass
            took = time.monotonic() - t1
            self._stats.record_upload(took, manifest.size)
            self._prune(self.storage)
        self._durable_step = max(step, self._durable_step or 0)
        self._stats.checkpoints += 1
        self._committed(manifest, "durable", took, durable=True)

    def _committed(self, manifest: Manifest, tier: str, seconds: float, durable: bool) -> None:
        if self.events:  # the record carries the stats, so the JSON lines are a `plan --stats` file too
            self.events.emit("checkpoint", step=manifest.step, reason=manifest.reason, tier=tier, durable=durable,
                             size=manifest.size, seconds=seconds, checkpoint_time=manifest.time,
                             **self._stats.as_dict())

    def _write(self, storage: Storage, step: int, reason: str, writer: checkpoint.Writer,
               deadline: float | None = None, cancel: threading.Event | None = None,
               extra: dict[str, Any] | None = None, replace: bool = False) -> Manifest | None:
        try:
            manifest = checkpoint.write(storage, step, {STATE_FILE: writer}, reason=reason,
                                        extra=self.extra if extra is None else extra,
                                        world_size=_world_size(), torch_version=torch.__version__,
                                        deadline=deadline, cancel=cancel, replace=replace,
                                        on_content=self._drop_stale_local(step) if replace else None)
        except CheckpointExistsError:
            logger.info("%s is already committed%s; not writing it twice", storage.describe(checkpoint.step_dir(step)),
                        " with this state" if replace else "")
            return None
        self.last_saved = manifest
        logger.info("%s checkpoint of step %d written to %s (%.1f MB)", reason, step, storage.describe(), manifest.size / 1e6)
        return manifest

    def _prune(self, storage: Storage) -> None:
        with self._lock:  # the loop's thread and the background writer may both prune
            try:
                checkpoint.prune(storage, self.options.keep)
            except Exception as e:
                logger.warning("pruning old checkpoints in %s failed: %s", storage.describe(), e)

    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        """Write a checkpoint of the current state as ``step`` now, synchronously, to the durable URL.

        Returns None when ``step`` is already committed. The global RNG streams are left exactly as
        they were, whatever the storage libraries draw while writing.
        """
        if self._saved_step == step:
            return None
        return self._save(step, reason, deadline)

    def _save(self, step: int, reason: str, deadline: float | None = None, replace: bool = False) -> Manifest | None:
        t0 = time.monotonic()
        if self._dist is not None:  # [distributed hook] collective sharded save (spotguard.checkpoint.sharded)
            manifest = self._dist.save(self, step, reason, deadline)  # prunes on rank 0
        else:
            with state.rng_isolated():
                # The final save is staged like periodic ones, so that an unchanged state serialises
                # to the same bytes as the periodic checkpoint of its step (and is not written again).
                payload = self._payload(step, staged=replace and self._stats.async_save)
                manifest = self._write(self.storage, step, reason, lambda f: torch.save(payload, f), deadline,
                                       replace=replace)
            self._saved_step = step
        if manifest is not None:
            took = time.monotonic() - t0
            self._stats.record_write(took, manifest.size)
            if self._adaptive is not None and reason in ("periodic", "advisory"):
                self._adaptive.observe(took)  # a synchronous save stalls the loop for all of it
            self._durable_step = max(step, self._durable_step or 0)
            self._stats.checkpoints += 1
            if self._dist is None:
                self._prune(self.storage)
            self._committed(manifest, "durable", took, durable=True)
        self._schedule(step)  # after observe(): the next save is due at the re-picked interval
        return manifest

    def _drop_stale_local(self, step: int) -> Callable[[tuple[checkpoint.FileEntry, ...]], None]:
        """For a final save: delete the local tier's checkpoint of ``step`` when its content differs
        from the final one, before the durable tier is touched (resume prefers the local copy)."""
        def check(entries: tuple[checkpoint.FileEntry, ...]) -> None:
            if self.local is None:
                return
            found = [i for i in checkpoint.scan(self.local) if i.step == step]
            for info in found:
                m = info.manifest
                if m is None or m.files != entries or m.extra != json.loads(json.dumps(self.extra)):
                    checkpoint.delete(self.local, info.name)
                    logger.info("removed %s: the final state of step %d differs", self.local.describe(info.name), step)
        return check

    def _save_logged(self, step: int, reason: str, replace: bool = False) -> None:
        try:
            self._save(step, reason, replace=replace) if replace else self.save(step, reason)
        except Exception as e:
            self._stats.failures += 1
            self._errors.append(e)
            logger.error("%s checkpoint of step %d failed: %s: %s; training goes on", reason, step, type(e).__name__, e)
            self.events.emit("failed", step=step, reason=reason, error=f"{type(e).__name__}: {e}")
            self._schedule(step)

    # -- the emergency ------------------------------------------------------------------------
    def _emergency(self, step: int, left: float | None = None) -> None:
        t0 = time.monotonic()
        try:
            self._emergency_save(step, left)
        finally:
            notice, resume_at = self.notice, self._durable_step
            self.events.emit("stop", step=step, committed=resume_at == step, resume_step=resume_at,
                             lost_steps=step - (resume_at or 0), seconds=time.monotonic() - t0,
                             kind=notice.kind if notice else None, provider=notice.provider if notice else None)

    def _emergency_save(self, step: int, left: float | None) -> None:
        self._beat[1] = heartbeat.STOPPED_FOR_NOTICE  # tells the supervisor: do not restart
        notice = self.notice
        if left is None:  # [distributed] ranks pass the earliest deadline among them
            left = notice.seconds_left() if notice else None
        if left is not None and left < EMERGENCY_FLOOR_S:
            logger.warning("the notice leaves %.1fs; the emergency checkpoint gets %.0fs, best effort",
                           left, EMERGENCY_FLOOR_S)
            left = EMERGENCY_FLOOR_S
        t0 = time.monotonic()
        deadline = None if left is None else t0 + left
        pending = self._pending
        decision = Inflight.NONE
        if pending is not None and not pending.done():
            decision = Inflight.SAME if pending.step == step else self._inflight_decision(pending, deadline)
        if self._dist is not None:  # [distributed hook] one collective save in flight: one decision for all ranks
            decision = Inflight(self._dist.agree_inflight(decision))
        if decision is Inflight.SAME:
            logger.warning("stop at step %d: its checkpoint is already being written; waiting for it", step)
            self._wait_pending(None if left is None else max(left, 0.0))
            if pending is not None and pending.committed:
                self._report_emergency(step, t0, left)
                return
        elif decision is Inflight.KEEP and (pending is None or pending.done()):
            return  # [distributed] this rank's part is done, another's is finishing: it is the resume point
        elif decision is not Inflight.NONE and pending is not None and \
                not self._settle_inflight(pending, step, deadline, decision):
            return  # the in-flight save is the resume point: the emergency one cannot make it
        self._reap()
        if self._saved_step == step and self._durable_step == step:
            logger.warning("stop at step %d: already checkpointed", step)
            if notice:
                self.watcher.acknowledge(notice)
            return
        estimate, size = self._emergency_estimate(), self._stats.state_bytes
        left_now = None if deadline is None else deadline - time.monotonic()
        logger.warning("emergency checkpoint of step %d: %s, estimated %s, %s", step,
                       f"{size / 1e6:.0f} MB" if size else "size unknown",
                       f"{estimate:.1f}s" if estimate is not None else "time unknown (no save measured yet)",
                       f"{left_now:.1f}s before the deadline" if left_now is not None else "no deadline known")
        self._saved_step = None if self._saved_step == step else self._saved_step
        try:
            self.save(step, "emergency", deadline=deadline)
        except Exception as e:
            self.emergency_error = e
            self._stats.failures += 1
            self.events.emit("failed", step=step, reason="emergency", error=f"{type(e).__name__}: {e}")
            resume_at = self._durable_step
            logger.error("emergency checkpoint of step %d NOT committed (%s: %s); resume point stays %s, "
                         "%d step(s) lost", step, type(e).__name__, e,
                         f"step {resume_at}" if resume_at is not None else "the start", step - (resume_at or 0))
            return
        self._stats.emergency_s = time.monotonic() - t0
        self._report_emergency(step, t0, left)

    def _emergency_estimate(self) -> float | None:
        """Seconds to write the state straight to the durable tier, from its measured throughput."""
        return self._stats.durable_seconds(two_tiers=self._two_tiers)

    @property
    def _two_tiers(self) -> bool:
        """Saves go to the local tier, then upload ([distributed] sharded saves go straight to the durable one)."""
        return self.local is not None and self._dist is None

    def _inflight_left(self, pending: PendingSave) -> float | None:
        """Estimated seconds until the in-flight save commits (None: not measured yet)."""
        st = self._stats
        expected = st.write_s if not self._two_tiers else (
            None if st.write_s is None or st.upload_s is None else st.write_s + st.upload_s)
        return None if expected is None else max(expected - (time.monotonic() - pending.started), 0.0)

    def _inflight_decision(self, pending: PendingSave, deadline: float | None) -> Inflight:
        """What to do with a periodic save of an older step, from measured times.

        Both fit in the time left: wait for it, then write the emergency checkpoint. The emergency
        one cannot fit: keep the in-flight one (unless it is known to miss too), it stays the
        resume point. Otherwise, or with nothing measured or no deadline, the newer state wins:
        abandon it.
        """
        left = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        fresh, rest = self._emergency_estimate(), self._inflight_left(pending)
        if deadline is not None and fresh is not None:
            if rest is not None and rest + fresh <= left * FIT:
                return Inflight.WAIT
            if fresh > left * FIT and (rest is None or rest <= left):
                return Inflight.KEEP
        return Inflight.ABANDON

    def _settle_inflight(self, pending: PendingSave, step: int, deadline: float | None, decision: Inflight) -> bool:
        """Carry out ``decision`` on the in-flight save; False when it stays the resume point instead
        of an emergency checkpoint. A save still running at the deadline is abandoned."""
        def left() -> float:
            return 0.0 if deadline is None else max(deadline - time.monotonic(), 0.0)

        fresh, rest = self._emergency_estimate() or 0.0, self._inflight_left(pending)
        if decision is Inflight.WAIT:
            logger.warning("stop at step %d: the save of step %d commits in ~%.1fs; waiting for it first",
                           step, pending.step, rest or 0.0)
            self._wait_pending(max(left() * FIT - fresh, 0.0))  # never into the emergency save's share
            if self._pending is None:
                return True
        elif decision is Inflight.KEEP:
            logger.error("emergency checkpoint of step %d needs ~%.1fs but %.1fs are left: finishing the "
                         "save of step %d instead (%s, %d step(s) will be lost)", step, fresh, left(),
                         pending.step, "time unknown" if rest is None else f"~{rest:.1f}s", step - pending.step)
            self._wait_pending(left())
            if self._pending is not None:
                pending.cancel()  # missed the deadline too: never hold the exit for it
            return False
        # The worker stops at its next file or before its manifest; never wait long for that,
        # its leftovers are swept by a later run.
        logger.warning("stop at step %d: abandoning the save of step %d for the newer state", step, pending.step)
        pending.cancel()
        self._wait_pending(CANCEL_GRACE_S if deadline is None else min(CANCEL_GRACE_S, left() / 10))
        return True

    def _report_emergency(self, step: int, t0: float, left: float | None) -> None:
        took = time.monotonic() - t0
        tail = "" if left is None else f", T-{left - took:.1f}s before the deadline"
        logger.warning("emergency checkpoint of step %d committed in %.2fs%s", step, took, tail)
        if self.notice:
            self.watcher.acknowledge(self.notice)  # e.g. Azure: approve the eviction, our state is safe

    # -- pending saves ------------------------------------------------------------------------
    def _wait_pending(self, timeout: float | None = None) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            pending.wait(timeout)
        except Exception:
            pass  # already logged by the worker; kept by _reap()
        self._reap()

    def _reap(self) -> None:
        pending = self._pending
        if pending is None or not pending.done():
            return
        self._pending = None
        if pending.error is not None:
            if pending.cancelled:
                logger.info("save of step %d was abandoned", pending.step)
            else:
                self._stats.failures += 1
                self._errors.append(pending.error)
                self.events.emit("failed", step=pending.step, reason=pending.reason,
                                 error=f"{type(pending.error).__name__}: {pending.error}")
            if self._saved_step == pending.step:
                self._saved_step = None

    def wait(self) -> None:
        """Block until every pending save is committed; raise the first background error, if any."""
        self._wait_pending()
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    def _every_seconds(self) -> float:
        if self._adaptive is None:
            return float(self.options.every_seconds or 0)
        # Never due faster than a background save takes to finish (it would only be skipped).
        busy = (self._stats.write_s or 0) + (self._stats.upload_s or 0) if self._stats.async_save else 0
        return max(self._adaptive.interval, busy)

    def _schedule(self, step: int) -> None:
        every = self.options.every_steps
        self._due_step = step + every if every else math.inf
        if self.options.every_seconds is not None:
            self._due_time = time.monotonic() + self._every_seconds()

    def _on_notice(self, notice: Notice) -> None:
        self._stats.notices[notice.kind] = self._stats.notices.get(notice.kind, 0) + 1
        self.events.emit("notice", **{k: v for k, v in notice.to_json().items() if k != "raw"})
        if notice.advisory and not self.options.stop_on_advisory and self.options.checkpoint_on_advisory:
            self._due_step = -math.inf  # the next step() checkpoints early (from the loop's thread)

    # -- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> Guard:
        if self._dist is not None and self._dist.group is None and ranks.is_distributed():
            # entered again after close(): collective too
            self._dist = agreement.setup(self.options.sync_every, async_save=self.options.async_sharded)
            self._abandoned = None  # a writer of the closed agreement is that agreement's (atexit) business
        self.watcher.start()
        if self._timed:
            self._due_time = time.monotonic() + self._every_seconds()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(save=exc_type is None)

    def close(self, save: bool = True) -> None:
        """Stop the watcher, finish pending saves and, after a clean finish, checkpoint the last step.

        After a clean finish, the first error of a background save is raised here (never lost).
        In a process group, the guard's own gloo groups are destroyed last, whatever happened
        (see ``Agreement.close``), so nothing of spotguard outlives the block; calling it again,
        or after ``dist.destroy_process_group()``, is harmless.
        """
        self.watcher.stop()  # restores the signal handlers (SIGINT included) and stops polling
        try:
            self._finish(save)
        finally:
            try:
                if self._dist is not None:
                    # [distributed] the background writer's group goes with its thread, never under a live one
                    writing = any(p is not None and not p.done() for p in (self._abandoned, self._pending))
                    self._dist.close(keep_async=writing)
            finally:
                self.events.emit("close", step=self._step, stopped_at=self.stopped_at)  # metrics stop on it

    def _finish(self, save: bool) -> None:
        pending = self._pending
        if pending is not None and pending.cancelled:
            self._pending = None  # abandoned for an emergency save: never hold the exit for it
            if self._dist is not None:  # [distributed] its ranks drop it together, soon: let its thread end
                self._abandoned = pending
                try:
                    pending.wait(CANCEL_GRACE_S * 5)
                except Exception:
                    pass  # abandoned: its error is no one's
        errors_before = len(self._errors)
        destroyed = self._dist is not None and self._dist.group is not None and not self._dist.usable
        if destroyed and self._pending is not None:
            # The program destroyed the process group inside the block: an async sharded save in flight
            # may be blocked in a collective that gloo never ends. Never hang the exit for it.
            self._wait_pending(DESTROYED_GRACE_S)
            if self._pending is not None:
                logger.error("the periodic checkpoint of step %d is stuck in a collective of the destroyed process "
                             "group; abandoned (with async_sharded=True, destroy it after the `with guard:` block)",
                             self._pending.step)
                self._pending.cancel()
                self._abandoned, self._pending = self._pending, None
        self._wait_pending()
        step = self._step
        # Single process: always, since the loop may have changed the state after its last guard.step()
        # (a scheduler stepped at the end of an epoch, guard.extra). An unchanged state is not written
        # twice; a changed one replaces the checkpoint of its step (checkpoint.write(replace=True)).
        # In a process group sharded saves are never replaced: only a step without one gets it.
        final = save and self.options.save_on_exit and self.stopped_at is None and (
            self._dist is None or step != self._durable_step)
        if destroyed:
            # No collective can run, and a periodic save in flight failed with the group (logged when
            # it did): not the run's failure. Errors from before stay and are raised below.
            lost = len(self._errors) - errors_before
            logger.warning("no final checkpoint of step %s: the process group was destroyed before the guard was "
                           "closed (call dist.destroy_process_group() after the `with guard:` block)%s", step,
                           f"; {lost} periodic checkpoint(s) in flight were lost with it" if lost else "")
            del self._errors[errors_before:]
            final = False
        elif final and self._dist is not None and not self._dist.usable:
            final = False  # closed already
        if final and step is not None:
            if self._dist is None:
                self._save_logged(step, "final", replace=True)
            else:
                if self._saved_step == step:
                    self._saved_step = None  # committed only to the local tier: write it durably now
                self._save_logged(step, "final")
        if save:
            self.wait()
        elif self._errors:
            logger.error("%d checkpoint error(s) during this run; the first: %s", len(self._errors), self._errors[0])
