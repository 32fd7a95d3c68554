"""``spotguard plan --plot``: goodput versus checkpoint interval, with the recommendation marked.

matplotlib is an optional extra (``pip install 'spotguard[plot]'``), imported only here and only
when a plot is asked for; the Agg backend draws to a file without a display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from spotguard.errors import MissingDependencyError, StorageError
from spotguard.planner import Plan, goodput


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or a ``MissingDependencyError``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'spotguard[plot]'") from e
    return plt


def plot_plan(p: Plan, path: str | Path) -> Path:
    """Draw the goodput curves of ``p`` to ``path`` (PNG, SVG or PDF by suffix)."""
    plt = pyplot()
    o = p.options
    job_s = o.job_hours * 3600.0
    lo, hi = max(o.checkpoint_s / 2.0, 1.0), min(job_s, max(20.0 * p.interval_s, 4.0 * 3600.0))
    xs = [lo * (hi / lo) ** (i / 299) for i in range(300)]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    plain = [goodput(x, o.checkpoint_s, o.restart_s, o.mtbf_s) for x in xs]
    ax.plot([x / 60 for x in xs], [100 * g for g in plain], label="periodic checkpoints only")
    marks = [r for r in p.rows if r.name.startswith("recommended")]
    if o.notice_s is not None:
        share = (o.notice_share or 0.0) if o.notice_works else 0.0
        with_notice = [
            goodput(x, o.checkpoint_s, o.restart_s, o.mtbf_s, notice_share=share, notice_s=o.notice_s) for x in xs
        ]
        ax.plot(
            [x / 60 for x in xs],
            [100 * g for g in with_notice],
            label=f"+ emergency checkpoint on notice ({100 * (o.notice_share or 0):.0f}% of preemptions)",
        )
        marks += [r for r in p.rows if r.emergency]
    for r in marks:
        assert r.interval_s is not None
        ax.plot(r.interval_s / 60, 100 * r.goodput, "o", color="black")
        ax.annotate(
            f"{r.interval_s / 60:.0f} min: {100 * r.goodput:.1f}%",
            (r.interval_s / 60, 100 * r.goodput),
            textcoords="offset points",
            xytext=(6, -14),
        )
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of compute)")
    ax.set_ylabel("expected goodput (%)")
    low = 100.0 * min(plain + [r.goodput for r in marks])
    ax.set_ylim(max(0.0, math.floor(low / 10.0) * 10.0), 100.0)
    ax.set_title(f"checkpoint {o.checkpoint_s:g} s, restart {o.restart_s:g} s, MTBF {o.mtbf_hours:g} h")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower center")
    fig.tight_layout()
    return save(plt, fig, path)


def save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` and close it (a ``StorageError`` when the file cannot be written)."""
    out = Path(path)
    try:
        fig.savefig(out)
    except OSError as e:
        raise StorageError(f"cannot write plot {out}: {e}") from e
    finally:
        plt.close(fig)
    return out
