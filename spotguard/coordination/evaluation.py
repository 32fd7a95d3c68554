"""``guard.evaluation()``: leave an evaluation early on a notice, and resume it exactly.

A notice that arrives during an evaluation should not wait for it to end (the deadline is 30 s on
GCP and Azure). The stop then falls between two training steps, where neither the RNG streams nor
the loader are what they were at the last step: the evaluation drew random numbers (sampling,
test-time augmentation, dropout left on) and the loader has ended its epoch. A checkpoint of that
state resumes into a new epoch at once and with other random draws. Inside ``guard.evaluation()``,
a save of the last training step keeps the streams as the evaluation found them and each loader as
at its last batch (``Cut``): the resumed run runs the evaluation again from its start, with the same
draws, then the next epoch, as the uninterrupted run does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from spotguard import heartbeat
from spotguard.checkpoint.engine import Cut, Tracked
from spotguard.checkpoint.state import state
from spotguard.coordination.agreement import NOTHING, STOP, Agreement


class Evaluation:
    """The context ``Guard.evaluation()`` returns; ``should_stop()`` says when to leave it."""

    def __init__(
        self,
        tracked: Tracked,
        step: int | None,
        stopping: Callable[[], bool],
        agreement: Agreement | None,
        activity: heartbeat.Activity | None = None,
    ) -> None:
        """``step``: the last training step, None before the first (step 0: an evaluation before training,
        as nanoGPT runs at iteration 0, is cut as one after step 0). ``stopping()``: whether a stop is pending
        (a notice, but not inside a notice window where training goes on: an evaluation cut there would
        change the draws of the steps after it)."""
        self._tracked, self._step, self._stopping, self._agreement = tracked, step or 0, stopping, agreement
        self._activity = activity or heartbeat.Activity()
        self._mark = 0
        self.cut_short = False  # should_stop() said yes

    def __enter__(self) -> Evaluation:
        # Kept past the block: a stop agreed at the step() call after it (a notice seen at the very end,
        # or on another rank) is still a stop of this step. A later step's save ignores it (another step).
        t = self._tracked
        t.cut = Cut(self._step, state.capture_rng(), copy.deepcopy(t.extra))
        self._mark = self._activity.begin(heartbeat.EVALUATING, self._step)  # `spotguard rehearse` sees it
        return self

    def should_stop(self) -> bool:
        """True when a stop notice arrived: leave the evaluation, then call ``guard.step(step)`` with the
        last training step. In a process group this is one all-reduce and the same answer on every rank:
        call it at the same batches on every rank (the evaluation's own collectives stay matched)."""
        stop = self._stopping()
        if self._agreement is not None:
            stop = self._agreement.vote(STOP if stop else NOTHING) == STOP
        self.cut_short |= stop
        return stop

    def __exit__(self, *exc: Any) -> None:
        self._activity.end(heartbeat.EVALUATING, self._mark)
