"""Ending a Ray Train attempt after a stop, the way Ray counts it.

Ray Train (>= 2.60) charges a restart to ``FailureConfig(max_preemption_failures=...)``, not to
``max_failures``, only when its controller itself ends the attempt for a preemption: once any worker
has seen ``get_preemption_info()`` the controller waits, and when Ray's deadline passes (plus
``preemption_grace_s``) or the drained node's workers die, it tears the group down with a
``PreemptionError``. A worker that raises in that time is an ordinary failure (``max_failures``), and
one that returns ends the whole run as finished. So after the emergency checkpoint a worker whose
stop Ray announced must do neither: ``end_attempt`` waits for Ray to end it. A stop Ray knows nothing
of (a notice file, the metadata service before the cluster drains the node) raises ``Preempted``:
Ray restarts the group as after any failure.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, NoReturn

from spotguard.errors import SpotguardError

if TYPE_CHECKING:
    from spotguard.guard import Guard

logger = logging.getLogger(__name__)

#: Ray Train's own wait when a drain states no deadline (``DEFAULT_PREEMPTION_DEADLINE_S``), seconds.
RAY_DEFAULT_DEADLINE_S = 120.0


class Preempted(SpotguardError, RuntimeError):
    """The worker stopped for a notice; its checkpoint is committed (or ``guard.emergency_error`` says why not)."""


def end_attempt(guard: Guard, patience: float = 300.0) -> NoReturn:
    """After ``guard.step()`` returned True (call it after leaving ``with guard:``): end this attempt.

    When Ray announced the stop (a ``ray`` notice), block until Ray Train ends the worker at its
    deadline; ``patience`` seconds past it (or past Ray's default wait when the drain stated none)
    it raises ``Preempted`` all the same, so that a worker is never left behind. Otherwise raise
    ``Preempted`` at once.
    """
    if patience < 0:
        raise ValueError(f"patience must be >= 0 seconds, got {patience!r}")
    watcher = guard.watcher
    ray_notices = [n for n in watcher.stops if n.provider == "ray"]
    where = (
        f"the checkpoint of step {guard.stopped_at} is committed"
        if guard.emergency_error is None
        else f"the emergency checkpoint failed ({guard.emergency_error}); the resume point is the last committed one"
    )
    if not ray_notices:
        raise Preempted(f"stopped at step {guard.stopped_at} for a notice Ray did not announce: {where}")
    lefts = [s for s in (n.seconds_left() for n in ray_notices) if s is not None]
    left = min(lefts) if lefts else None
    wait = (RAY_DEFAULT_DEADLINE_S if left is None else max(left, 0.0)) + patience
    logger.warning(
        "stopped at step %s for Ray's preemption notice: %s; waiting for Ray Train to end this attempt "
        "as a preemption (%s)",
        guard.stopped_at,
        where,
        "no deadline stated" if left is None else f"deadline in {left:.1f}s",
    )
    threading.Event().wait(wait)  # Ray kills this process at its deadline; nothing here needs waking
    raise Preempted(
        f"Ray Train did not end the attempt within {wait:.0f}s of its preemption notice; ending it as a failure"
    )
