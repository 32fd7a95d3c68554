"""What every trainer integration shares: the notice flag, the rank vote, and trainer folders as checkpoints.

Trainers write their checkpoint as a folder of files, with no commit marker and no checksums; a
kill during the save leaves a folder that looks whole, and resuming from it fails or, worse,
loads half a state. ``FolderCheckpoints`` commits such a folder to spotguard storage (files
first, manifest with SHA-256 last), prunes, and finds the newest folder that verifies for the
resume. ``NoticeWatch`` wraps spotguard's ``Watcher``; its ``check(step)`` is the verdict of a
step: one attribute read in a single process, one all-reduce of one integer in a process group
(the ``Guard``'s agreement), so that every rank stops after the same step. With
``deadline_policy="use-window"`` it follows the Guard's ``WindowPolicy``: after the first emergency
checkpoint ``stop_saved`` says whether to train on, and ``check`` says when the second stop is due.
Its ``marks`` (``Marks``) tell ``spotguard rehearse`` when the trainer saves or evaluates.

In a process group (``torch.distributed`` initialised, world size > 1) both become collective
through one ``RankGroup``: the folder every rank (or node) wrote is committed as one checkpoint
(``spotguard.checkpoint.folders``), and the resume fetches one verified copy per node, without the
files of other nodes' ranks (each trainer's rule: ``_rankfiles``). Every rank must then call
``check``, ``commit`` and ``newest_verified`` at the same points, in the same order.
"""

from __future__ import annotations

import functools
import gc
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from spotguard import _env, checkpoint, heartbeat
from spotguard.checkpoint import folders, layout
from spotguard.checkpoint.leaseholder import DEFAULT_TTL_S
from spotguard.checkpoint.manifest import Manifest
from spotguard.checkpoint.pernode import RankFiles
from spotguard.checkpoint.reader import none_loads, refuse_newer_format
from spotguard.guard import agreement, ranks
from spotguard.guard.agreement import ADVISORY, NOTHING, STOP, Agreement
from spotguard.guard.lease import WriterLease
from spotguard.guard.options import Unloadable
from spotguard.guard.window import DeadlinePolicy, WindowPolicy
from spotguard.heartbeat import EXIT_PREEMPTED
from spotguard.planner import DEFAULT_WINDOW_MARGIN_S

from ..errors import CheckpointCorruptError, CheckpointExistsError, ConfigError, LeaseHeldError
from ..notices.base import Notice, NoticeProvider
from ..storage import Storage, open_storage
from ..watcher import Watcher

if TYPE_CHECKING:
    from typing_extensions import Unpack  # noqa: F401  (in typing from 3.11)

logger = logging.getLogger(__name__)


class WatchOptions(TypedDict, total=False):
    """What every trainer integration takes by keyword, as for ``spotguard.Guard``: ``keep`` (3)
    checkpoints are kept; ``providers`` ("auto") / ``interval`` (1 s): what to watch and how often;
    ``stop_on_advisory`` (False): stop on an advisory notice instead of only checkpointing early;
    ``work_dir`` (the system's temp directory): where verified copies are fetched for a resume;
    ``on_unloadable`` ("raise"): when checkpoints exist but none loads, the resume raises
    ``NoLoadableCheckpointError`` ("fresh": starts from the beginning with a warning);
    ``lease_ttl`` (60) / ``takeover`` ($SPOTGUARD_TAKEOVER): the run's writer lease, as for ``Guard``;
    ``deadline_policy`` ($SPOTGUARD_DEADLINE_POLICY, else "stop") / ``window_margin`` (5 s): after the
    emergency checkpoint of a notice with a deadline, stop, or train on and checkpoint again before the
    deadline ("use-window"), as for ``Guard`` (``spotguard.guard.window``)."""

    keep: int
    lease_ttl: float | None
    takeover: bool
    on_unloadable: str
    providers: str | Iterable[str | NoticeProvider] | None
    interval: float
    stop_on_advisory: bool
    work_dir: str | None
    deadline_policy: DeadlinePolicy | str | None
    window_margin: float


def watch_parts(storage: str | Storage | None, options: WatchOptions) -> tuple[FolderCheckpoints, NoticeWatch]:
    """The checkpoint folder and the notice watch of an integration, from its ``WatchOptions``."""
    unknown = sorted(set(options) - set(WatchOptions.__annotations__))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}; known: every_steps (where taken), {', '.join(WatchOptions.__annotations__)}"
        )
    windowing = WindowPolicy(options.get("deadline_policy"), options.get("window_margin", DEFAULT_WINDOW_MARGIN_S))
    group = RankGroup(windowing)
    fresh_ok = Unloadable(options.get("on_unloadable", Unloadable.RAISE)) is Unloadable.FRESH
    checkpoints = FolderCheckpoints(
        storage,
        options.get("keep", 3),
        options.get("work_dir"),
        group,
        fresh_ok,
        lease_ttl=options.get("lease_ttl", DEFAULT_TTL_S),
        takeover=options.get("takeover"),
    )
    notices = NoticeWatch(
        ranks.providers_for_rank(options.get("providers", "auto")),
        options.get("interval", 1.0),
        options.get("stop_on_advisory", False),
        group=group,
        windowing=windowing,
        release=checkpoints.release,
    )
    return checkpoints, notices


class RankGroup:
    """An integration's share of the process group: the ``Guard``'s agreement (two small gloo
    groups), made on first use, on every rank at the same point (making it is collective).
    ``get()`` is None in a single process, or before ``torch.distributed`` is initialised. Making it checks
    that every rank uses the same deadline policy (``ConfigError`` on every rank otherwise)."""

    def __init__(self, windowing: WindowPolicy | None = None) -> None:
        self._agreement: Agreement | None = None
        self._settled = False
        self._same = (windowing or WindowPolicy()).settings()

    def get(self) -> Agreement | None:
        if self._settled:
            return self._agreement  # the per-step path: no look at torch.distributed
        if self._agreement is None and ranks.is_distributed() and ranks.world_size() > 1:
            self._agreement = agreement.setup(sync_every=1, same=self._same)
        return self._agreement

    def settle(self) -> None:
        """From now on (training runs: the process group, if any, is up) ``get()`` is one attribute read."""
        self.get()
        self._settled = True

    @property
    def rank(self) -> int:
        return self._agreement.rank if self._agreement is not None else 0

    def close(self) -> None:
        """Destroy spotguard's groups (idempotent); a later ``get()`` makes new ones."""
        self._settled = False
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None


class Marks:
    """The heartbeat's ``SAVING`` and ``EVALUATING`` marks of an integration, as the ``Guard`` sets them
    (``heartbeat.Activity``): ``spotguard rehearse --during-save/--during-eval`` times notices into them.

    A trainer's save or evaluation often begins in one hook and ends in another, so a mark is held
    here by its slot: ``begin`` while one is held keeps the earlier start (the save began before this
    hook), ``end`` clears it (nothing when none is held). ``during`` is both around one block."""

    def __init__(self, slots: memoryview) -> None:
        #: Also what ``guard.evaluation()`` (the Guard's ``Evaluation``) marks through.
        self.activity = heartbeat.Activity(slots)
        self._held: dict[int, int] = {}

    def begin(self, slot: int, step: int) -> None:
        if slot not in self._held:
            self._held[slot] = self.activity.begin(slot, step)

    def end(self, slot: int) -> None:
        mark = self._held.pop(slot, None)
        if mark is not None:
            self.activity.end(slot, mark)

    def held(self, slot: int) -> bool:
        return slot in self._held

    @contextmanager
    def during(self, slot: int, step: int, *, last: bool = False) -> Iterator[None]:
        """Marked for the block. A mark held already stays after it, unless the block is the save's or
        the evaluation's ``last`` part (a trainer's commit of the folder it wrote)."""
        ends = last or slot not in self._held
        self.begin(slot, step)
        try:
            yield
        finally:
            if ends:
                self.end(slot)


class NoticeWatch:
    """Notices from signals and cloud metadata as two flags the training loop can read for free.

    ``due`` is True once any notice arrived on this rank (stop or advisory). ``preempted`` (an
    Event) is set for this rank's stop notices only; ``stopping`` once this rank or any other
    saw one (``check`` agreed on it). Call ``start()`` from the main thread (signal handlers),
    ``stop()`` when training ends. After a stop's emergency checkpoint (committed or not) the
    integration calls ``stop_saved``: it says whether to train on in the notice window
    (``windowing``, ``deadline_policy="use-window"``), and tells ``spotguard run`` and the cloud.
    """

    def __init__(
        self,
        providers: str | Iterable[str | NoticeProvider] | None = "auto",
        interval: float = 1.0,
        stop_on_advisory: bool = False,
        group: RankGroup | None = None,
        windowing: WindowPolicy | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        # sigint: Ctrl-C, or `spotguard run` forwarding one, is a notice, as for Guard
        self.watcher = Watcher(
            providers, interval, on_notice=self._on_notice, stop_on_advisory=stop_on_advisory, sigint=True
        )
        self.preempted = self.watcher.preempted
        self.due = False
        self.windowing = windowing or WindowPolicy()
        self.group = group or RankGroup(self.windowing)
        #: True once the ranks agreed to stop (this rank's notice, or another rank's).
        self.stopping = False
        #: Why the stop's (first) emergency checkpoint was not committed; None when it was (or no stop yet).
        self.emergency_error: BaseException | None = None
        #: ``"use-window"``: why the second checkpoint was not committed (the first stays the resume point).
        self.window_error: BaseException | None = None
        self._stop_on_advisory = stop_on_advisory
        self._release = release  # the writer lease, given back after the stop's last checkpoint
        self._advisory = False
        self._peer: Notice | None = None
        self._deadline: float | None = None  # monotonic, from the earliest deadline of all ranks
        #: Shared with `spotguard run` when $SPOTGUARD_HEARTBEAT is set: [last step, flags, marks].
        self._beat = heartbeat.attach()
        #: The heartbeat's marks of a save in flight and of an evaluation (``spotguard rehearse`` sees them).
        self.marks = Marks(self._beat)

    def check(self, step: int, stop_only: bool = False, tick: bool | None = None) -> int:
        """The verdict of ``step``: ``NOTHING``, ``ADVISORY`` (checkpoint, go on) or ``STOP``.

        In a single process one attribute read when nothing is due. In a process group it is
        collective (one all-reduce of one integer): every rank calls it at the same points and
        gets the same verdict, also when only another rank saw the notice. An advisory verdict is
        consumed (the next check says ``NOTHING`` until a new notice); ``stop_only`` (where no
        checkpoint can be written, e.g. inside an evaluation) leaves advisories for later.
        In the notice window the verdict is ``STOP`` once the second checkpoint is due, else
        ``NOTHING``; ``tick`` (default: not ``stop_only``) says that a training step ended here.
        """
        self._beat[0] = step  # `spotguard run`'s hang watchdog: one memory write
        agreed = self.group.get()
        window = self.windowing.window
        if agreed is None:
            if not self.due or (stop_only and not self.preempted.is_set()):
                return NOTHING
            if window is not None:
                verdict = STOP if window.closing(tick=not stop_only if tick is None else tick) else NOTHING
            else:
                verdict = STOP if self.preempted.is_set() else ADVISORY
        else:
            if window is not None:  # the ranks vote on the second stop: any rank's clock may call it
                own = STOP if window.closing(tick=not stop_only if tick is None else tick) else NOTHING
            else:
                own = STOP if self.preempted.is_set() else ADVISORY if self._advisory and not stop_only else NOTHING
            verdict = agreed.vote(own)
            if stop_only and verdict != STOP:
                return NOTHING
        if verdict == STOP:
            if window is not None:
                self.windowing.end()  # the second stop: its checkpoint goes before the window's deadline
            elif not self.stopping:
                self._agree_stop(agreed, step)
        elif verdict == ADVISORY:
            self.take_advisory()
        return verdict

    @property
    def in_window(self) -> bool:
        """Training on in the notice window: no periodic checkpoint (the second stop's comes soon)."""
        return self.windowing.window is not None

    def stop_saved(
        self, step: int, error: BaseException | None = None, save_s: float | None = None, *, may_train_on: bool = True
    ) -> bool:
        """After the stop's checkpoint of ``step``: committed now or before (``error`` None), or not.

        ``save_s``: the seconds that checkpoint took (or the last one measured, when ``step`` was
        committed before; None: unknown). Returns True to train on in the notice window: the first
        stop, ``deadline_policy="use-window"``, a deadline, time beyond the reserve, and
        ``may_train_on`` (False where the trainer has left its loop). [distributed] Collective when
        a deadline is known: call it on every rank at the same point. Then, on the stop's last
        checkpoint: the writer lease is given back and, last, the cloud told (Azure approves the
        eviction and may take the machine at once: a lease still held would keep the replacement
        waiting for its TTL)."""
        if error is None:
            self._beat[1] |= heartbeat.COMMITTED  # `spotguard run` exits 75 only then; the first commit stands
        spent = self.windowing.end()
        if spent is not None:  # the second stop: whatever happens, the first checkpoint stands
            self.window_error = error
            if error is not None:
                logger.error(
                    "the second checkpoint of the notice window (step %d) is NOT committed: the resume point "
                    "stays the first, step %d",
                    step,
                    spent.first_step,
                )
        else:
            self.emergency_error = error
            if may_train_on and self.windowing.open(
                step, self.deadline(), save_s if error is None else None, self.group.get()
            ):
                return True  # the cloud is told after the second checkpoint: Azure evicts once approved
        if self._release is not None:
            self._release()  # nothing more is written: the replacement machine takes the lease at once
        if error is None and self.watcher.notice is not None:
            # e.g. Azure: approve the eviction, the state is safe. Last: the machine may go at once then.
            self.watcher.acknowledge(self.watcher.notice)
        return False

    def _agree_stop(self, agreed: Agreement | None, step: int) -> None:
        self.stopping = True
        self._beat[1] |= heartbeat.STOPPED_FOR_NOTICE  # also where only another rank saw the notice
        if agreed is None:
            return
        left, self._peer = agreed.agree_stop(step, self.watcher.notice)
        self._deadline = None if left is None else time.monotonic() + left
        if self._peer is not None:
            logger.warning("rank %d: another rank saw a notice: stopping after step %d with it", agreed.rank, step)

    def _on_notice(self, notice: Notice) -> None:
        if self.windowing.cut(notice, self._stop_on_advisory):
            return  # in the notice window: a later stop notice brings the second checkpoint forward
        if not self.preempted.is_set():
            self._advisory = True
        else:  # the job exits 75 now (exit_code): `spotguard run` reads it here when a launcher hides it
            self._beat[1] |= heartbeat.STOPPED_FOR_NOTICE
        self.due = True  # last: the loop's reader sees the reason already set

    @property
    def notice(self) -> Notice | None:
        """This rank's notice, or the one another rank saw (provider "peer") after a stop was agreed."""
        return self.watcher.notice or self._peer

    def take_advisory(self) -> bool:
        """True once per advisory notice (checkpoint early, go on); re-arms ``due`` accordingly."""
        advisory, self._advisory = self._advisory, False
        self.due = self.preempted.is_set()
        return advisory

    def deadline(self) -> float | None:
        """The notice deadline as a ``time.monotonic()`` value (for storage retries), or None; in a
        process group the earliest deadline of all ranks, once the stop is agreed; in or after the
        notice window, the window's (a later notice may have brought it forward)."""
        window = self.windowing.window or self.windowing.spent
        if window is not None:
            return window.deadline
        if self._deadline is not None:
            return self._deadline
        left = self.watcher.notice.seconds_left() if self.watcher.notice else None
        return None if left is None else time.monotonic() + left

    def start(self) -> None:
        self.group.settle()
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()
        if self.exit_code:
            # The job exits next. The interpreter's last garbage collection walks every object a
            # trainer imported (3.5 s measured here with transformers loaded, 0.4 s frozen): time
            # the notice window does not have, and under torchrun a rank still tearing down when
            # another has exited is killed (-15) and its "preempted" code lost.
            gc.freeze()

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice (on any rank), else 0: the job's exit code
        (also after a second checkpoint of the notice window that failed: the first is the resume point)."""
        return EXIT_PREEMPTED if self.preempted.is_set() or self.stopping else 0


class StopOutcome:
    """What every integration says about its stop, read from its ``notices`` (a ``NoticeWatch``)."""

    notices: NoticeWatch

    @property
    def emergency_error(self) -> BaseException | None:
        """Why the stop's (first) emergency checkpoint was not committed; None when it was."""
        return self.notices.emergency_error

    @property
    def window_error(self) -> BaseException | None:
        """``"use-window"``: why the second checkpoint was not committed (the first is the resume point)."""
        return self.notices.window_error


class FolderCheckpoints:
    """A trainer's checkpoint folders, committed to spotguard storage as ``step-N/`` with a manifest.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``). ``work_dir``
    holds the verified copies fetched for a resume (default: the system's temp directory). In a
    process group (``group``) ``commit`` and ``newest_verified`` are collective: every rank passes
    the folder it (or its node) wrote, and gets the folder its node fetched. The first of them takes
    the run's writer lease (docs/lease.md; ``lease_ttl=None``: none), ``release()`` gives it back
    (the integrations' ``close()``; after a stop's last checkpoint, ``NoticeWatch.stop_saved``).
    """

    def __init__(
        self,
        storage: str | Storage | None,
        keep: int = 3,
        work_dir: str | None = None,
        group: RankGroup | None = None,
        fresh_ok: bool = False,
        *,
        lease_ttl: float | None = DEFAULT_TTL_S,
        takeover: bool | None = None,
    ) -> None:
        storage = _env.storage_or_env(storage)
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
        if lease_ttl is not None and not (isinstance(lease_ttl, (int, float)) and 0 < lease_ttl < 1e7):
            raise ConfigError(f"lease_ttl must be a positive number of seconds or None, got {lease_ttl!r}")
        self.storage = storage if isinstance(storage, Storage) else open_storage(storage)
        takeover = _env.flag(_env.TAKEOVER, default=False) if takeover is None else takeover
        self.lease = WriterLease(self.storage, lease_ttl, bool(takeover), None, self)
        self._beat = heartbeat.attach()  # `spotguard run` does not restart a job another one writes over
        self.keep = keep
        self.work_dir = work_dir
        self.group = group or RankGroup()
        self.fresh_ok = fresh_ok  # on_unloadable="fresh": checkpoints that all fail to load mean a fresh start
        self.last_saved: Manifest | None = None
        self._fetched: list[Path] = []

    def commit(
        self,
        step: int,
        folder: str | Path,
        reason: str,
        deadline: float | None = None,
        extra: dict[str, Any] | None = None,
        supersede: bool = False,
    ) -> Manifest | None:
        """Store ``folder`` as checkpoint ``step`` (manifest last) and prune; None when already committed.
        ``supersede``: a committed checkpoint of ``step`` holds another state; this one replaces it, as the
        step's next revision (``step-N.rK/``): the old one stays the resume point until this one is
        committed, and ``prune`` deletes it then.

        Collective in a process group: every rank passes its own folder (see ``folders.commit``)."""
        t0 = time.monotonic()
        self._hold()
        agreed = self.group.get()
        if agreed is None:
            revision = layout.next_revision(self.storage, step) if supersede else 0
            write = functools.partial(checkpoint.write_dir, self.storage, revision=revision)
        else:
            write = functools.partial(folders.commit, self.storage, agreed, supersede=supersede)
        try:
            manifest = write(
                step, Path(folder), reason=reason, extra=extra, torch_version=torch.__version__, deadline=deadline
            )
        except CheckpointExistsError:
            logger.info("%s is already committed", self.storage.describe(checkpoint.step_dir(step)))
            return None
        except LeaseHeldError:  # LeaseLostError: another job took the run over; nothing was committed
            self._lease_lost("")
            raise
        self.last_saved = manifest  # (after a stop's last checkpoint NoticeWatch.stop_saved releases the lease)
        took = time.monotonic() - t0
        tail = "" if deadline is None else f", T-{deadline - time.monotonic():.1f}s before the deadline"
        logger.log(
            logging.WARNING if reason == "emergency" else logging.INFO,
            "%s checkpoint of step %d committed to %s in %.2fs (%.1f MB)%s",
            reason,
            step,
            self.storage.describe(),
            took,
            manifest.size / 1e6,
            tail,
        )
        if self.group.rank != 0:
            return manifest  # rank 0 prunes for all
        try:
            checkpoint.prune(self.storage, self.keep)
        except Exception as e:
            logger.warning("pruning old checkpoints in %s failed: %s", self.storage.describe(), e)
        return manifest

    def newest_verified(self, rank_files: RankFiles | None = None) -> tuple[int, Path] | None:
        """The newest checkpoint whose files all match their manifest, as a local folder, and its step.

        Folders without a manifest (a save cut short), or whose files fail their checksums, are
        skipped with a warning naming the reason, and the previous one is tried; a newer spotguard's
        checkpoint raises ``CheckpointFormatError`` (upgrade spotguard). Collective in a process
        group: the same step on every rank, one verified copy per node (``folders.fetch``), holding
        the shared files and the node's own ranks' files (``rank_files``: the trainer's rule; None: all).
        """
        self._hold()
        agreed = self.group.get()
        if agreed is not None:
            found = folders.fetch(self.storage, agreed, self.work_dir, rank_files, fresh_ok=self.fresh_ok)
            if found is not None and folders.is_node_leader():
                self._fetched.append(found[1])
            return found
        skipped: list[str] = []
        for info in reversed(checkpoint.scan(self.storage)):
            where = self.storage.describe(info.name)
            refuse_newer_format(self.storage, info)  # a newer spotguard's: upgrade, never fall back past it
            if not info.complete:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                if info.status != "incomplete":  # a save cut short is no lost work; a corrupt one is
                    skipped.append(f"{where}: {info.status} ({info.problem})")
                continue
            if self.work_dir:
                Path(self.work_dir).mkdir(parents=True, exist_ok=True)
            dest = Path(tempfile.mkdtemp(prefix=f"spotguard-{info.name}-", dir=self.work_dir))
            try:
                checkpoint.fetch(self.storage, info, dest)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                skipped.append(f"{where}: {e}")
                shutil.rmtree(dest, ignore_errors=True)
                continue
            self._fetched.append(dest)
            logger.info(
                "resuming from %s (step %d, %s)", where, info.step, info.manifest.reason if info.manifest else "?"
            )
            return info.step, dest
        if skipped and not self.fresh_ok:
            raise none_loads(self.storage, skipped)
        logger.log(
            logging.WARNING if skipped else logging.INFO,
            "no checkpoint that loads in %s: starting from the beginning",
            self.storage.describe(),
        )
        return None

    def _hold(self) -> None:
        """The run's writer lease, before the first load or commit (collective in a process group)."""
        self.lease.agreement = self.group.get()
        try:
            self.lease.hold()
        except LeaseHeldError:
            self._lease_lost("")
            raise

    def _lease_lost(self, why: str) -> None:
        self._beat[1] |= heartbeat.LEASE_HELD  # `spotguard run` exits 73, no restart

    def release(self) -> None:
        """This job writes nothing more here: the next job on the storage takes the lease at once."""
        self.lease.release()

    def loaded(self) -> None:
        """After the trainer loaded the fetched copy on every rank: remove it. Collective in a process
        group (a barrier first: the ranks of a node share one copy)."""
        agreed = self.group.get()
        if agreed is not None:
            agreed.reduce(0, agreed.save_group)
        self.cleanup()

    def adopt(self, path: Path) -> None:
        """Remove ``path`` too at ``cleanup``: a fetched copy moved there."""
        self._fetched.append(path)

    def cleanup(self) -> None:
        """Remove the local copies fetched for a resume (the trainer has loaded them; in a process
        group, every rank of the node has: call it after a collective that follows the load)."""
        for path in self._fetched:
            shutil.rmtree(path, ignore_errors=True)
        self._fetched.clear()
