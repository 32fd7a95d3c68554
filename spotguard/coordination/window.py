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

``WindowPolicy`` holds these steps once for the ``Guard`` and for the trainer integrations (their
``NoticeWatch``): ``open`` after the first checkpoint, ``closing`` after each step, ``cut`` on a later
notice, ``end`` at the second stop. In a process group every rank must use the same policy and
margin: ``settings()`` is checked when the ranks' ``Agreement`` is made (a ``ConfigError`` on every
rank, not a hang at the first window).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spotguard import _env
from spotguard.errors import ConfigError
from spotguard.planner import DEFAULT_WINDOW_MARGIN_S, window_reserve

if TYPE_CHECKING:
    from spotguard.coordination.agreement import Agreement
    from spotguard.notices.base import Notice

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

    def closing(self, now: float | None = None, tick: bool = True) -> bool:
        """After a step: whether one more step would eat into the reserve (then write the second checkpoint).
        ``tick=False`` asks without ending a step (inside an evaluation: its time counts in the step's)."""
        now = time.monotonic() if now is None else now
        if tick:
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


def parse_policy(value: str) -> DeadlinePolicy:
    try:
        return DeadlinePolicy(value.lower())
    except ValueError:
        raise ValueError(f"must be one of {[p.value for p in DeadlinePolicy]}, got {value!r}") from None


class WindowPolicy:
    """A stop's notice window, for the ``Guard`` and every trainer integration alike.

    ``policy`` (None: ``$SPOTGUARD_DEADLINE_POLICY``, else ``"stop"``) and ``margin_s`` are checked
    here. Order: after the first emergency checkpoint ``open()`` (collective in a process group when
    the deadline is known); while ``window`` is set, ``closing()`` after each step (the ranks vote on
    it); ``cut()`` from the watcher for a later notice; ``end()`` at the second stop, whose checkpoint
    is written before ``spent.deadline``.
    """

    def __init__(self, policy: DeadlinePolicy | str | None = None, margin_s: float = DEFAULT_WINDOW_MARGIN_S) -> None:
        if policy is None:  # not given: the job's environment decides (a fleet's unit, a pod spec)
            policy = _env.choices(_env.DEADLINE_POLICY, DeadlinePolicy.STOP, parse_policy)
        try:
            self.policy = DeadlinePolicy(policy)
        except ValueError:
            raise ConfigError(
                f"deadline_policy must be one of {[p.value for p in DeadlinePolicy]}, got {policy!r}"
            ) from None
        if isinstance(margin_s, bool) or not (isinstance(margin_s, (int, float)) and 0 <= margin_s < math.inf):
            raise ConfigError(f"window_margin must be a number of seconds >= 0, got {margin_s!r}")
        self.margin_s = float(margin_s)
        self.window: Window | None = None  # open: training goes on after the first checkpoint
        self.spent: Window | None = None  # ended: the stop's second checkpoint is (being) written

    @property
    def wanted(self) -> bool:
        return self.policy is DeadlinePolicy.USE_WINDOW

    def settings(self) -> dict[str, tuple[float, tuple[str, ...] | None]]:
        """What every rank of a process group must share: a number each (with the names of an enum's)."""
        names = tuple(p.value for p in DeadlinePolicy)
        return {
            "deadline_policy": (float(names.index(self.policy.value)), names),
            "window_margin": (self.margin_s, None),
        }

    def open(
        self, step: int, deadline: float | None, save_s: float | None, agreement: Agreement | None = None
    ) -> Window | None:
        """After the first emergency checkpoint of ``step``: the window to train on in, or None (stop now).

        ``deadline``: ``time.monotonic()`` of the notice's (in a process group the earliest, known alike
        on every rank); ``save_s``: that checkpoint's measured seconds, None when it was not committed or
        not measured. [distributed] Collective when a deadline is known: the slowest save and the least
        time left decide for every rank, so all open the window or none does."""
        if not self.wanted:
            return None
        if deadline is None:
            logger.info("the notice has no deadline: stopping at step %d (no window to use)", step)
            return None
        save = math.inf if save_s is None else save_s
        left = deadline - time.monotonic()
        if agreement is not None:
            save, left = agreement.agree_window(save, left)
        self.window = Window.open(step, deadline, save, self.margin_s, left)
        return self.window

    def closing(self, tick: bool = True) -> bool:
        """In an open window, after a step: whether to write the second checkpoint now."""
        return self.window is not None and self.window.closing(tick=tick)

    def end(self) -> Window | None:
        """The second stop: the window closes (its checkpoint goes before ``spent.deadline``)."""
        if self.window is not None:
            self.spent, self.window = self.window, None
        return self.spent

    def cut(self, notice: Notice, stop_on_advisory: bool) -> bool:
        """A notice while the window is open: a stop notice brings its deadline forward. True: handled."""
        window = self.window
        if window is None:
            return False
        if stop_on_advisory or not notice.advisory:
            window.cut(notice.seconds_left())  # no longer than the later notice allows
        return True

    def describe(self) -> dict[str, Any]:
        """For the ``window`` event: how long is left, the save time and the reserve."""
        w = self.window
        return {} if w is None else {"deadline_in": w.left(), "save_s": w.save_s, "reserve_s": w.reserve_s}
