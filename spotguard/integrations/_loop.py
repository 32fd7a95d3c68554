"""The loop side of an integration for a training loop the user writes (Accelerate, DeepSpeed).

``guard.step(n)`` after every step: nearly free when nothing is due in a single process, one vote
in a process group; a periodic or advisory checkpoint when due, the emergency checkpoint and True
(stop) after a notice on any rank; with ``deadline_policy="use-window"`` False after that first
emergency checkpoint while the notice window lasts, and True after the second one (``NoticeWatch``).
Subclasses say how a checkpoint is written (``save``) and read (``resume``); the schedule, the
emergency and the lifetime (``with guard:``) are the same for all.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from spotguard.checkpoint.format.manifest import Manifest

from ..coordination.agreement import ADVISORY, STOP
from ..coordination.cadence import next_multiple
from ..coordination.options import check_every_steps, check_flag
from ..errors import ConfigError
from ..notices.base import Notice
from ..storage import Storage
from ._common import StopOutcome, WatchOptions, watch_parts

logger = logging.getLogger(__name__)

G = TypeVar("G", bound="LoopGuard")


@dataclass
class LoopOptions(WatchOptions):
    """``WatchOptions`` and the loop's schedule: ``every_steps``, periodic checkpoints (None: only on
    notices and at the end); ``save_on_exit``, a clean exit from ``with guard:`` checkpoints the last step."""

    every_steps: int | None = None
    save_on_exit: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_every_steps(self.every_steps)
        check_flag("save_on_exit", self.save_on_exit)


class LoopGuard(StopOutcome):
    """Checkpoints a hand-written training loop periodically and on a notice (subclass: ``save``/``resume``).

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``). ``options``:
    ``LoopOptions`` by name (``every_steps``, ``save_on_exit`` and the ``spotguard.Guard``'s own).
    """

    def __init__(self, storage: str | Storage | None, options: dict[str, Any]) -> None:
        o = LoopOptions.from_kwargs(options, type(self).__name__)
        self.checkpoints, self.notices = watch_parts(storage, o)
        self.every_steps = o.every_steps
        self.save_on_exit = o.save_on_exit
        #: The step this run stopped at for a notice, or None (also while training on in the notice window).
        self.stopped_at: int | None = None
        self._save_s: float | None = None  # how long the last checkpoint took (the notice window's reserve)
        self._watch = self.notices  # one attribute lookup less on the hot path
        self._beat = self.notices._beat
        self._step: int | None = None
        self._saved_step: int | None = None
        self._due_step: float = math.inf
        self._grouped = False  # in a process group: every step is a vote
        self._schedule(0)

    @property
    def notice(self) -> Notice | None:
        return self.notices.notice

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice (on any rank), else 0."""
        return self.notices.exit_code

    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        raise NotImplementedError

    def resume(self) -> int:
        raise NotImplementedError

    def _resumed(self, step: int) -> None:
        """Subclasses' ``resume``, once the state of ``step`` is loaded."""
        self._step = self._saved_step = step
        self._schedule(step)

    def _saved(self, step: int) -> None:
        """Subclasses' ``save``, once checkpoint ``step`` is committed."""
        self._saved_step = step
        self._schedule(step)

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        """Call after each completed step, on every rank. Saves when due; True means stop (checkpoint
        committed). In a process group the ranks vote (one all-reduce of one integer per step)."""
        if self._watch.due or step >= self._due_step or self._grouped:
            return self._step_slow(step)
        self._step = step
        self._beat.step(step)  # the heartbeat: `spotguard run`'s hang watchdog sees the step
        return False

    def _step_slow(self, step: int) -> bool:
        self._step = step
        verdict = self.notices.check(step)
        if verdict == STOP:
            if self.stopped_at is None:
                self.stopped_at = step
                if self._emergency(step):
                    self.stopped_at = None  # the notice window: train on, checkpoint again before the deadline
                    return False
            return True
        if verdict != ADVISORY and (step < self._due_step or self.notices.in_window):
            return False
        reason = "advisory" if verdict == ADVISORY else "periodic"
        try:
            self._timed_save(step, reason)
        except ConfigError:  # the state cannot be checkpointed at all (the same on every rank): say so now
            raise
        except Exception as e:  # a failed periodic save must not end the training
            logger.error("%s checkpoint of step %d failed: %s: %s; training goes on", reason, step, type(e).__name__, e)
            self._schedule(step)
        return False

    def _timed_save(self, step: int, reason: str, deadline: float | None = None) -> None:
        t0 = time.monotonic()
        self.save(step, reason, deadline=deadline)
        self._save_s = time.monotonic() - t0

    def _holds(self, step: int) -> bool:
        """Whether the committed checkpoint of ``step`` is what a stop at ``step`` must leave (subclasses:
        not when it was written before an evaluation a notice then cut short)."""
        return self._saved_step == step

    def _emergency(self, step: int) -> bool:
        """The stop's checkpoint of ``step``; True: train on in the notice window (``NoticeWatch.emergency``)."""
        return self.notices.emergency(
            step,
            self._holds(step),
            lambda deadline: self._timed_save(step, "emergency", deadline=deadline),
            self._save_s,
            self._saved_step,
        )

    def _schedule(self, step: int) -> None:
        self._due_step = next_multiple(step, self.every_steps)  # on multiples of N, as HF's save_steps

    # -- lifetime ----------------------------------------------------------------------------
    def __enter__(self: G) -> G:
        self._grouped = self.checkpoints.group.get() is not None
        self.notices.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(save=exc_type is None)

    def close(self, save: bool = True) -> None:
        """Stop watching; after a clean finish, checkpoint the last step if it is not saved yet."""
        self.notices.stop()
        try:
            if (
                save
                and self.save_on_exit
                and self.stopped_at is None
                and self._step is not None
                and self._step != self._saved_step
            ):
                self.save(self._step, "final")
        finally:
            self.checkpoints.release()
            self.checkpoints.group.close()
