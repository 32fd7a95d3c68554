"""The writer lease's fence, as the checkpoint writers call it before each manifest (``leaseholder``)."""

from __future__ import annotations

from collections.abc import Callable

#: A writer lease's fence (``leaseholder.Lease.fence``): raises ``LeaseLostError`` once the lease is lost,
#: else returns the monotonic time by which a manifest must have landed (None: no bound).
Fence = Callable[[], "float | None"]


def fenced(fence: Fence | None, deadline: float | None) -> float | None:
    """Call ``fence`` before a manifest; returns the manifest's deadline: the sooner of ``deadline`` and the
    lease's own. Why: a manifest retried past it (300 s of retries against a 60 s lease) could land after
    another job, seeing no renewal, took the run over and resumed from an older step."""
    bound = fence() if fence is not None else None
    return deadline if bound is None else bound if deadline is None else min(deadline, bound)
