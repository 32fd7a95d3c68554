"""Notice sources polled from the training loop, where the ranks already synchronise.

A source whose check is itself a collective (``NoticeProvider.in_step``: Ray's
``get_preemption_info``, a barrier across the workers) cannot run in a watcher thread: a rank whose
thread polled once more than another's would leave the barrier waiting. The Guard polls it here,
from ``step()``: in a process group on sync steps only, when the vote says so (any rank's clock
found the interval gone: ``Agreement.vote_poll``), so that every rank makes the same calls at the
same step; in a single process on its own clock. The call costs a round trip to Ray's
synchronisation actor (``bench/ray_preemption.py`` measures it); one per ``interval`` keeps its
share of a step small whatever the step time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from spotguard.coordination.agreement import STOP, Agreement
from spotguard.errors import ConfigError
from spotguard.notices.base import Notice, NoticeProvider

logger = logging.getLogger(__name__)


class InStep:
    """The in-step sources of one Guard, their clock, and where their notices go (``report``)."""

    def __init__(
        self,
        sources: Iterable[NoticeProvider],
        interval: float,
        report: Callable[[Notice], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sources = list(sources)
        self.interval = interval
        self.report = report
        self.clock = clock
        self._next = clock()  # the first step polls: a restarted run learns of a drain at once
        self.polls = 0
        self.polled_step: int | None = None  # the step of the last poll

    @classmethod
    def of(
        cls, providers: Iterable[NoticeProvider], interval: float, report: Callable[[Notice], None], distributed: bool
    ) -> InStep | None:
        """The Guard's in-step sources, or None when it has none (``step()`` then pays nothing).

        Outside a process group every worker of a multi-worker Ray run would poll on its own clock and
        break the barrier: a ``ConfigError`` says so instead.
        """
        sources = [p for p in providers if p.in_step]
        if not sources:
            return None
        crowded = [p.name for p in sources if getattr(p, "world_size", 1) > 1]
        if crowded and not distributed:
            raise ConfigError(
                f"notice source(s) {crowded} are collective across the workers and need an initialised "
                "torch.distributed process group (TorchTrainer) so that every rank polls them at the same "
                "step; leave them out of providers (e.g. providers='signal') in a trainer without one"
            )
        floor = max(float(getattr(p, "min_interval", 0.0)) for p in sources)
        return cls(sources, max(interval, floor), report)

    def vote(self, agreement: Agreement, code: int, step: int, window_open: bool) -> int:
        """[distributed] The step's verdict, the in-step sources polled by every rank when the vote says
        so. Their answer is the same on every rank: a stop it announces is every rank's at this step
        (in a notice window the next vote closes it, as for any notice)."""
        verdict, poll = agreement.vote_poll(code, self.due())
        if poll:
            self.polled_step = step
            if self.poll() and not window_open:
                verdict = STOP
        return verdict

    def tick(self, step: int) -> None:
        """[single process] Poll when this process's clock says so (no other rank waits in the barrier)."""
        if self.due():
            self.polled_step = step
            self.poll()

    def at_stop(self, step: int) -> None:
        """At a first stop, on every rank alike: poll once more unless this step's vote just did, so that a
        drain announced with the machine's own notice brings its (earlier) deadline in."""
        if self.polled_step != step:
            self.polled_step = step
            self.poll()

    def due(self) -> bool:
        """This rank's clock says the interval since the last poll is gone."""
        return self.clock() >= self._next

    def poll(self) -> bool:
        """Check every in-step source once (on every rank together); True when one announced a stop.

        What a source raises is logged, never raised into training (the watcher's rule): the answer of a
        collective is the same on every rank, so every rank logs it alike and none leaves the others.
        """
        self._next = self.clock() + self.interval
        self.polls += 1
        stop = False
        for source in self.sources:
            try:
                notice = source.poll()
            except Exception as e:
                logger.warning("notice source %s failed (%s: %s)", source.name, type(e).__name__, e)
                continue
            if notice is not None:
                self.report(notice)
                stop = stop or not notice.advisory
        return stop
