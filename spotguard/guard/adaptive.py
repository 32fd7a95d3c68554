"""The periodic interval behind ``every_seconds="auto"``: the planner's model, fed with measured costs.

Split from ``spotguard.planner`` (the offline model behind ``spotguard plan``): this is the runtime
part the guard's schedule (``guard.schedule``) keeps, re-picking the interval as checkpoints are timed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from spotguard.errors import ConfigError
from spotguard.planner import checked_number, daly_interval

logger = logging.getLogger(__name__)


class AdaptiveInterval:
    """The periodic interval behind ``every_seconds="auto"``, re-picked from measured costs.

    Call ``observe(seconds)`` after each checkpoint (or time it with ``measure()``); ``interval`` is
    Daly's estimate for the moving average of the last ``window`` costs, like ``plan()``: with
    ``notice_s``/``notice_share`` it only covers the preemptions without a usable notice, and
    falls back to all of them when checkpoints get slower than the notice lead. The interval in use
    changes only when the estimate moves more than ``tolerance`` (relative) away from it, so noise
    in the measurements neither reschedules nor floods the log; every change is logged.
    """

    def __init__(
        self,
        mtbf_hours: float,
        *,
        notice_s: float | None = None,
        notice_share: float = 0.0,
        initial_s: float = 600.0,
        window: int = 8,
        tolerance: float = 0.1,
        min_s: float = 1.0,
        max_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mtbf_s = checked_number("mtbf_hours", mtbf_hours) * 3600.0
        self.notice_s = None if notice_s is None else checked_number("notice_s", notice_s)
        self.notice_share = checked_number("notice_share", notice_share, zero=True)
        if self.notice_share > 1:
            raise ConfigError(f"notice_share is a fraction in [0, 1], got {notice_share!r}")
        self.min_s = checked_number("min_s", min_s)
        self.max_s = float(max_s)
        if not self.max_s >= self.min_s:
            raise ConfigError(f"max_s must be >= min_s, got {max_s!r} < {min_s!r}")
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be an int >= 1, got {window!r}")
        if not 0 <= tolerance < 1:
            raise ConfigError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.tolerance = tolerance
        self.clock = clock
        self._costs: deque[float] = deque(maxlen=window)
        self.interval = min(max(checked_number("initial_s", initial_s), self.min_s), self.max_s)

    @property
    def mean_cost(self) -> float | None:
        return sum(self._costs) / len(self._costs) if self._costs else None

    def observe(self, checkpoint_seconds: float) -> float:
        """Record one measured checkpoint cost; return the (possibly re-picked) interval."""
        self._costs.append(checked_number("checkpoint_seconds", checkpoint_seconds, zero=True))
        cost = self.mean_cost or 0.0
        share = self.notice_share if self.notice_s is not None and self.notice_s >= cost else 0.0
        mtbf = self.mtbf_s / (1.0 - share) if share < 1.0 else math.inf
        target = min(max(daly_interval(cost, mtbf), self.min_s), self.max_s)
        if abs(target - self.interval) > self.tolerance * self.interval:
            logger.info(
                "checkpoint interval %.0fs -> %.0fs (mean checkpoint cost %.2fs over %d, MTBF %.1fh)",
                self.interval,
                target,
                cost,
                len(self._costs),
                mtbf / 3600.0,
            )
            self.interval = target
        return self.interval

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Time the block with ``clock`` and ``observe()`` it (only when it succeeds)."""
        t0 = self.clock()
        yield
        self.observe(self.clock() - t0)
