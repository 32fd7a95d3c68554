"""Metrics of a training job and of ``spotguard run``: Prometheus (``spotguard[metrics]``) and JSON lines.

``Guard(..., metrics_port=9400, metrics_file="metrics.jsonl")`` or ``export(guard, ...)``; ``spotguard
run --metrics-port P --metrics-file F`` for the supervisor. The endpoint binds 127.0.0.1 unless told
otherwise (``metrics_host="0.0.0.0"`` to let a Prometheus server elsewhere scrape it). See
``spotguard.metrics.guard`` and ``spotguard.ops.supervisor.metrics`` for what is exported and how it is measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .guard import GuardMetrics, Watched

__all__ = ["GuardMetrics", "export"]


def __getattr__(name: str) -> Any:
    # GuardMetrics reads the Guard's ranks (torch.distributed): loaded on first use, so that
    # ``spotguard run --metrics-port`` (``spotguard.ops.supervisor.metrics``) starts without torch.
    if name == "GuardMetrics":
        from .guard import GuardMetrics

        return GuardMetrics
    raise AttributeError(f"module 'spotguard.metrics' has no attribute {name!r}")


def export(
    guard: Watched,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    jsonl: str | None = None,
    registry: Any = None,
    per_rank: bool = True,
    sample_s: float = 1.0,
) -> GuardMetrics:
    """Export ``guard``'s figures: an HTTP endpoint on ``host:port`` (0: a free port), JSON lines
    appended to ``jsonl``, and/or a collector registered in a prometheus_client ``registry`` you serve
    yourself. Under torchrun (``per_rank``) rank N serves on ``port + LOCAL_RANK`` and ``{rank}`` /
    ``{local_rank}`` in ``jsonl`` are filled in. The guard closes it when it closes; ``reopen()`` it
    for another ``with guard:`` block (``Guard(metrics_...)`` does that itself).
    """
    from .guard import GuardMetrics

    place = guard.place()  # read through the guard: the metrics never import the guard package
    if per_rank and place.world_size > 1:
        if port:
            port += place.local_rank
        if jsonl:
            jsonl = place.format(jsonl)
    return GuardMetrics(guard, port=port, host=host, jsonl=jsonl, registry=registry, sample_s=sample_s)
