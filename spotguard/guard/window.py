"""Spend the notice window: train on after the emergency checkpoint, and checkpoint again before the deadline.

A stop notice with a deadline (AWS gives two minutes) leaves the machine paid for until then. With
``deadline_policy="stop"`` the loop stops after the current step, commits the emergency checkpoint and
exits: the rest of the window is idle. With ``"use-window"`` the order is:

1. the emergency checkpoint of the stop step is committed at once, exactly as with ``"stop"``: the
   safety net, the resume point should anything below go wrong;
2. ``Window.open`` decides whether there is time to train on: the time left must exceed the
   reserve, i.e. the measured save time (that first emergency save; in a process group the slowest
   rank's) plus a quarter of it plus the margin (``planner.window_reserve``, the rule ``spotguard
   plan`` models). Without a deadline (a plain SIGTERM), without a
   measured save, or after a failed one, there is no window: it is ``"stop"``;
3. training goes on; after each step ``Window.closing()`` says whether one more step (as long as the
   longest step seen in the window) would leave less than the reserve. In a process group the ranks
   vote on it, so every rank takes the second stop at the same step. Another stop notice in the
   window (the SIGTERM of a shutdown, Ctrl-C) brings its deadline forward, to now without one;
4. the second checkpoint is written under the deadline, and the guard stops. If it cannot finish,
   the first one stays the newest complete checkpoint, and the resume point.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass

from spotguard.planner import window_reserve

logger = logging.getLogger(__name__)


class DeadlinePolicy(str, enum.Enum):
    """What a stop notice with a deadline does once its emergency checkpoint is committed."""

    STOP = "stop"  # stop training at once; the rest of the notice window is idle
    USE_WINDOW = "use-window"  # train on, and checkpoint again just in time before the deadline


@dataclass
class Window:
    """An open notice window: the first emergency checkpoint is committed and training goes on."""

    first_step: int
    deadline: float  # time.monotonic() of the notice deadline (in a process group, the earliest of all ranks)
    save_s: float  # the measured save time (in a process group, the slowest rank's)
    margin_s: float
    last: float  # time.monotonic() when the previous step ended
    step_s: float = 0.0  # the longest step seen in the window (between sync steps in a process group)

    @property
    def reserve_s(self) -> float:
        return window_reserve(self.save_s, self.margin_s)

    @classmethod
    def open(cls, first_step: int, deadline: float, save_s: float, margin_s: float, left: float) -> Window | None:
        """A window after the first checkpoint of ``first_step``, or None when ``left`` seconds (the
        least of all ranks) leave no time to train before the reserve. ``save_s`` is inf when unknown."""
        if not math.isfinite(save_s) or left <= window_reserve(save_s, margin_s):
            logger.warning(
                "notice window not used: %s; stopping now",
                "the save time is not known"
                if not math.isfinite(save_s)
                else f"{left:.1f}s left, {window_reserve(save_s, margin_s):.1f}s needed for a second checkpoint",
            )
            return None
        window = cls(first_step, deadline, save_s, margin_s, time.monotonic())
        logger.warning(
            "emergency checkpoint of step %d committed; training on in the notice window: %.1fs left, the "
            "second checkpoint starts about %.1fs before the deadline (save %.1fs measured, margin %.1fs)",
            first_step,
            left,
            window.reserve_s,
            save_s,
            margin_s,
        )
        return window

    def closing(self, now: float | None = None) -> bool:
        """After a step: whether one more step would eat into the reserve (then write the second checkpoint)."""
        now = time.monotonic() if now is None else now
        self.step_s = max(self.step_s, now - self.last)
        self.last = now
        return now + self.step_s + self.reserve_s >= self.deadline

    def cut(self, seconds_left: float | None) -> None:
        """Another stop notice came in the window (a SIGTERM as the machine shuts down, Ctrl-C): its
        deadline, or now when it has none, if that is sooner. From the watcher's thread: one assignment."""
        deadline = time.monotonic() + max(seconds_left or 0.0, 0.0)
        if deadline < self.deadline:
            self.deadline = deadline
            logger.warning(
                "another stop notice in the window: its deadline, %.1fs from now, is sooner", seconds_left or 0.0
            )

    def left(self) -> float:
        """Seconds to the deadline now."""
        return self.deadline - time.monotonic()
