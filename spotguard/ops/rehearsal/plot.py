"""``spotguard rehearse --plot``: steps over time, the notices marked, and the time lost per cause.

matplotlib is an optional extra (``pip install 'spotguard[plot]'``), imported only here and only
when a plot is asked for; the Agg backend draws to a file without a display.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from spotguard.ops.plot import pyplot, save

if TYPE_CHECKING:
    from . import Result

#: Causes of lost time, in the order they are drawn, and their colours.
CAUSES = {
    "stop, save and teardown": "tab:orange",
    "restart and resume": "tab:red",
    "steps replayed": "tab:purple",
}


def plot_rehearsal(result: Result, path: str | Path) -> Path:
    """Draw ``result`` to ``path`` (PNG, SVG or PDF by suffix)."""
    plt = pyplot()
    machines = result.machines
    t0 = machines[0].start if machines else 0.0
    fig, (ax, bars) = plt.subplots(
        1, 2, figsize=(10, 4.2), dpi=110, gridspec_kw={"width_ratios": [3, 1]}, constrained_layout=True
    )
    lost = dict.fromkeys(CAUSES, 0.0)
    for i, m in enumerate(machines):
        if m.timeline:
            ax.step([t - t0 for t, _ in m.timeline], [s for _, s in m.timeline], where="post", color="tab:blue")
            stop = m.timeline[-1][0]
            if m.preempted:
                ax.axvspan(stop - t0, m.end - t0, color=CAUSES["stop, save and teardown"], alpha=0.3, lw=0)
                lost["stop, save and teardown"] += m.end - stop
        if m.notice is not None:
            ax.axvline(m.notice - t0, color="black", ls="--", lw=0.8)
        if i + 1 < len(machines) and machines[i + 1].first_step is not None:
            nxt = machines[i + 1].first_step
            assert nxt is not None
            ax.axvspan(m.end - t0, nxt - t0, color=CAUSES["restart and resume"], alpha=0.3, lw=0)
            lost["restart and resume"] += nxt - m.end
    for p in result.report.preemptions:
        if p.steps_replayed and result.report.steps:
            lost["steps replayed"] += p.steps_replayed * result.report.useful_s / result.report.steps
    ax.set_xlabel("seconds since the first start (dashed: a notice)")
    ax.set_ylabel("step")
    g, pg = result.report.goodput, result.report.planner_goodput
    ax.set_title(
        f"{len(result.report.preemptions)} preemptions: goodput "
        f"{'-' if g is None else f'{100 * g:.1f}%'} (planner {'-' if pg is None else f'{100 * pg:.1f}%'})"
    )
    ax.grid(True, alpha=0.3)
    names = list(CAUSES)
    bars.barh(names, [lost[n] for n in names], color=[CAUSES[n] for n in names])
    bars.set_xlabel("seconds lost")
    bars.invert_yaxis()
    return save(plt, fig, path)
