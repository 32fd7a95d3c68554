"""What every trainer integration shares: the notice flag and the rank vote, and how they are made.

``NoticeWatch`` wraps spotguard's ``Watcher``; its ``check(step)`` is the verdict of a step: one
attribute read in a single process, one all-reduce of one integer in a process group (the
``Guard``'s agreement, ``RankGroup``), so that every rank stops after the same step. With
``deadline_policy="use-window"`` it follows the Guard's ``WindowPolicy``: after the first emergency
checkpoint ``stop_saved`` says whether to train on, and ``check`` says when the second stop is due.
Its ``marks`` (the heartbeat's ``Activity``) tell ``spotguard rehearse`` when the trainer saves or evaluates.
``watch_parts`` makes it with the trainer's ``FolderCheckpoints`` (``_folders``) over one
``RankGroup``: in a process group (``torch.distributed`` initialised, world size > 1) every rank
must then call ``check``, ``commit`` and ``newest_verified`` at the same points, in the same order.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from spotguard import heartbeat
from spotguard.coordination import ranks
from spotguard.coordination.agreement import ADVISORY, NOTHING, STOP, Agreement
from spotguard.coordination.group import RankGroup
from spotguard.coordination.options import CommonOptions, Unloadable
from spotguard.coordination.stopping import StopProtocol
from spotguard.coordination.window import WindowPolicy
from spotguard.heartbeat import EXIT_CONFIG, EXIT_PREEMPTED

from ..notices.base import Notice, NoticeProvider
from ..storage import Storage
from ..watcher import Watcher
from ..weakcall import weakly
from ._folders import FolderCheckpoints

logger = logging.getLogger(__name__)


@dataclass
class WatchOptions(CommonOptions):
    """What every trainer integration takes by keyword: ``CommonOptions`` (``keep``, ``providers``,
    ``interval``, ``stop_on_advisory``, ``on_unloadable``, ``untracked``, ``rebatch``, ``deadline_policy``,
    ``window_margin``, ``lease_ttl``, ``takeover``), as for ``spotguard.Guard``, and ``work_dir`` (the
    system's temp directory): where verified copies are fetched for a resume."""

    owner: ClassVar[str] = "a trainer integration"

    work_dir: str | None = None


def saved_already(step: int) -> str:
    """Why a stop at the resume point ``step`` writes nothing: 0 is a fresh start, which holds nothing to save."""
    return "nothing trained yet, no checkpoint needed" if step == 0 else "already checkpointed"


def watch_parts(
    storage: str | Storage | None, options: dict[str, Any] | WatchOptions, owner: str | None = None
) -> tuple[FolderCheckpoints, NoticeWatch]:
    """The checkpoint folder and the notice watch of an integration (``owner``), from its keyword
    ``options`` (``WatchOptions``: an unknown or invalid one is a ``ConfigError``)."""
    o = options if isinstance(options, WatchOptions) else WatchOptions.from_kwargs(options, owner)
    windowing = WindowPolicy(o.deadline_policy, o.window_margin)
    group = RankGroup(windowing)
    checkpoints = FolderCheckpoints(
        storage,
        o.keep,
        o.work_dir,
        group,
        Unloadable(o.on_unloadable) is Unloadable.FRESH,
        lease_ttl=o.lease_ttl,
        takeover=o.takeover,
        untracked=o.untracked,
        rebatch=o.rebatch,
    )
    notices = NoticeWatch(
        ranks.providers_for_rank(o.providers),
        o.interval,
        bool(o.stop_on_advisory),
        group=group,
        windowing=windowing,
        release=checkpoints.release,
    )
    return checkpoints, notices


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
        stop_on_advisory: bool = False,  # watch_parts: the option, else $SPOTGUARD_STOP_ON_ADVISORY (WatchOptions)
        group: RankGroup | None = None,
        windowing: WindowPolicy | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        # sigint: Ctrl-C, or `spotguard run` forwarding one, is a notice, as for Guard
        self.watcher = Watcher(
            providers, interval, on_notice=weakly(self._on_notice), stop_on_advisory=stop_on_advisory, sigint=True
        )
        self.preempted = self.watcher.preempted
        self.due = False
        self.windowing = windowing or WindowPolicy()
        self.group = group or RankGroup(self.windowing)
        #: True once the ranks agreed to stop (this rank's notice, or another rank's).
        self.stopping = False
        self._stop_on_advisory = stop_on_advisory
        self._advisory = False
        self._peer: Notice | None = None
        self._deadline: float | None = None  # monotonic, from the earliest deadline of all ranks
        #: Shared with `spotguard run` when $SPOTGUARD_HEARTBEAT is set: [last step, flags, marks].
        self._beat = heartbeat.Beat()
        #: The stop protocol (``coordination.stopping``): flags, outcome, lease and cloud, in the Guard's order.
        self.protocol = StopProtocol(self._beat, self.windowing, release, self.watcher.acknowledge)
        #: The heartbeat's marks of a save in flight and of an evaluation (``spotguard rehearse`` sees them).
        self.marks = self._beat.activity

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
        self._beat.step(step)  # `spotguard run`'s hang watchdog: one memory write
        agreed = self.group.get()
        window = self.windowing.window
        stop, tick = self.preempted.is_set(), not stop_only if tick is None else tick
        if agreed is None:
            if not self.due or (stop_only and not stop):
                return NOTHING
            verdict = self.protocol.verdict(stop, True, tick)  # due, not a stop: an advisory
        else:  # the ranks vote; in the notice window on the second stop: any rank's clock may call it
            verdict = agreed.vote(self.protocol.verdict(stop, self._advisory and not stop_only, tick))
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
        return self.protocol.saved(
            step, error, save_s, self.deadline, self.group.get(), self.watcher.notice, may_train_on
        )

    def emergency(
        self,
        step: int,
        committed: bool,
        write: Callable[[float | None], object],
        last_save_s: float | None,
        resume_step: int | None,
        *,
        where: str = "after step",
        may_train_on: bool = True,
    ) -> bool:
        """The stop's checkpoint of ``step``, the same in every integration; True: train on in the notice
        window (``stop_saved``). ``committed``: ``step`` is committed already (the resume point is safe;
        ``last_save_s`` is what its save took), else ``write(deadline)`` writes and commits it now, raising
        on failure (``resume_step`` stays the resume point then). ``where``: how the log says it stopped."""
        if committed:  # or step 0 of a fresh start (an evaluation or a sanity check before training)
            logger.warning("stop at step %d: %s", step, saved_already(step))
            return self.stop_saved(step, save_s=last_save_s, may_train_on=may_train_on)
        logger.warning("stopping %s %d for a notice: writing the emergency checkpoint", where, step)
        error, save_s = self.protocol.write(step, lambda: write(self.deadline()), lambda: resume_step)
        return self.stop_saved(step, error, save_s, may_train_on=may_train_on)

    def _agree_stop(self, agreed: Agreement | None, step: int) -> None:
        self.stopping = True
        left, self._peer = self.protocol.stopped(step, agreed, self.watcher.notice)  # the flag, the vote
        if agreed is not None:  # in one process deadline() follows this rank's notice
            self._deadline = None if left is None else time.monotonic() + left

    def _on_notice(self, notice: Notice) -> None:
        if self.windowing.cut(notice, self._stop_on_advisory):
            return  # in the notice window: a later stop notice brings the second checkpoint forward
        if not self.preempted.is_set():
            self._advisory = True
        else:  # the job exits 75 now (exit_code): `spotguard run` reads it here when a launcher hides it
            self._beat.stopped()
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


def exit_refused(error: BaseException) -> int:
    """The job's exit code for a resume refused with ``error`` (``errors.PERMANENT``): a restart would
    meet it again, so ``spotguard run`` does not retry (``EXIT_CONFIG``)."""
    logger.error("cannot resume: %s: %s", type(error).__name__, error)
    return EXIT_CONFIG


class StopOutcome:
    """What every integration says about its stop, read from its ``notices`` (a ``NoticeWatch``)."""

    notices: NoticeWatch

    @property
    def emergency_error(self) -> BaseException | None:
        """Why the stop's (first) emergency checkpoint was not committed; None when it was."""
        return self.notices.protocol.emergency_error

    @property
    def window_error(self) -> BaseException | None:
        """``"use-window"``: why the second checkpoint was not committed (the first is the resume point)."""
        return self.notices.protocol.window_error
