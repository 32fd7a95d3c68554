"""When the next periodic checkpoint is due: on multiples of N steps, every T seconds, or early on an advisory.

``Guard.step()`` reads ``due_step`` and ``due_time`` directly (two comparisons on the hot path);
everything else happens only when a save is due or done. ``every_seconds="auto"`` re-picks the
interval from the measured cost of each checkpoint (Young/Daly, ``guard.adaptive.AdaptiveInterval``).
"""

from __future__ import annotations

import math
import time

from spotguard.coordination.cadence import next_multiple
from spotguard.guard.adaptive import AdaptiveInterval
from spotguard.guard.stats import GuardStats


class Schedule:
    """The due step and due time of the next periodic checkpoint, and whether an advisory asked for one now."""

    def __init__(
        self, every_steps: int | None, every_seconds: float | str | None, mtbf_hours: float | None, stats: GuardStats
    ) -> None:
        self.every_steps = every_steps
        self.timed = every_seconds is not None
        self._fixed_s = float(every_seconds) if isinstance(every_seconds, (int, float)) else 0.0
        self.adaptive = AdaptiveInterval(mtbf_hours) if every_seconds == "auto" and mtbf_hours else None
        self._stats = stats
        #: An advisory notice asked for a checkpoint at the next step (the watcher's thread sets it).
        self.advisory = False
        self.due_step: float = math.inf
        self.due_time: float = math.inf
        self.after(0)

    def every_seconds(self) -> float:
        """The time interval in use (0 when saves are not timed)."""
        if self.adaptive is None:
            return self._fixed_s
        # Never due faster than a background save takes to finish (it would only be skipped).
        st = self._stats
        busy = (st.write_s or 0) + (st.upload_s or 0) if st.async_save else 0
        return max(self.adaptive.interval, busy)

    def is_due(self, step: int) -> bool:
        return step >= self.due_step or (self.timed and time.monotonic() >= self.due_time)

    def reason(self) -> str:
        return "advisory" if self.advisory else "periodic"

    def start(self) -> None:
        """The loop starts (``with guard:``): the first timed save is one interval from now."""
        if self.timed:
            self.due_time = time.monotonic() + self.every_seconds()

    def after(self, step: int) -> None:
        """A save of ``step`` was written, skipped or failed, or ``step`` was resumed: plan the next one."""
        self.advisory = False
        self.due_step = next_multiple(step, self.every_steps)
        if self.timed:
            self.due_time = time.monotonic() + self.every_seconds()

    def early(self) -> None:
        """An advisory notice: checkpoint at the next step (called from the watcher's thread)."""
        self.advisory = True
        self.due_step = 0  # any step is due: step() takes its slow path, which reads ``advisory``

    def observe(self, seconds: float) -> None:
        """What a checkpoint cost the loop (``every_seconds="auto"`` re-picks the interval from it)."""
        if self.adaptive is not None:
            self.adaptive.observe(seconds)
