"""The writer lease's fence, as the checkpoint writers call it before a save and before its manifest (``leaseholder``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from spotguard.errors import PreconditionFailedError, StorageError

logger = logging.getLogger(__name__)

#: A writer lease's fence (``leaseholder.Lease.fence``): raises ``LeaseLostError`` once the lease is lost,
#: else returns the monotonic time by which a manifest must have landed (None: no bound).
Fence = Callable[[], "float | None"]


def fenced(fence: Fence | None, deadline: float | None) -> float | None:
    """Call ``fence`` before a manifest; returns the manifest's deadline: the sooner of ``deadline`` and the
    lease's own. Why: a manifest retried past it (300 s of retries against a 60 s lease) could land after
    another job, seeing no renewal, took the run over and resumed from an older step."""
    bound = fence() if fence is not None else None
    return deadline if bound is None else bound if deadline is None else min(deadline, bound)


def fence_first(fence: Fence | None) -> None:
    """Call ``fence`` before a save deletes what it takes for leftovers of its step: ``LeaseLostError`` when
    another job holds the run (they may be its save of that step, in progress). A storage fault is only logged:
    the fence before the manifest decides, and a passing fault must not cost an emergency save its files."""
    if fence is None:
        return
    try:
        fence()
    except PreconditionFailedError:  # the record changed under the renewal's second try: taken over, as likely as not
        raise
    except StorageError as e:
        logger.warning("cannot renew the writer lease before a save (%s); the commit renews it", e)
