"""How much the planner's recommendation is worth, checked by simulation, and how fast it answers.

Scenario: checkpoint 60 s, restart 180 s, MTBF 6 h (a busy spot pool), 90% of preemptions with
AWS's 120 s notice. Goodputs are simulated (spotguard.ops.goodput, 3000 MTBFs of work, fixed seeds)
and compared with baselines simulated in the same run: hourly checkpoints, and the
recommendation without emergency checkpoints.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import emit, parser, row  # noqa: E402

from spotguard.ops.goodput import SimOptions, simulate  # noqa: E402
from spotguard.planner import PlanOptions, plan  # noqa: E402

COST, RESTART, MTBF, SHARE = 60.0, 180.0, 6.0, 0.9


def sim(interval: float, *, notice: bool = False, seed: int = 1) -> float:
    return simulate(
        SimOptions(
            COST,
            RESTART,
            interval,
            job_hours=3000 * MTBF,
            mtbf_hours=MTBF,
            notice_share=SHARE if notice else 0.0,
            cloud="aws",
            seed=seed,
        )
    ).goodput


def best_of(fn, repeat: int = 20) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    plain = plan(PlanOptions(COST, RESTART, MTBF))
    noticed = plan(PlanOptions(COST, RESTART, MTBF, notice_s=120.0, notice_share=SHARE))
    g_plain, g_hourly = sim(plain.interval_s), sim(3600.0)
    g_noticed = sim(noticed.interval_s, notice=True)
    diff = max(abs(g_plain - plain.goodput), abs(g_noticed - noticed.goodput))
    t0 = time.perf_counter()
    r = simulate(SimOptions(COST, RESTART, plain.interval_s, job_hours=3000 * MTBF, mtbf_hours=MTBF, seed=2))
    sim_s = time.perf_counter() - t0
    rows = [
        row(
            f"goodput, Young/Daly interval ({plain.interval_s / 60:.0f} min), simulated",
            g_plain,
            "",
            baseline=g_hourly,
            baseline_label="hourly checkpoints",
            target="ratio >= 1",
            passed=lambda v, ratio: ratio is not None and ratio >= 1.0,
        ),
        row(
            f"goodput, notice (90%, 120 s) + interval ({noticed.interval_s / 60:.0f} min), simulated",
            g_noticed,
            "",
            baseline=g_plain,
            baseline_label="Young/Daly without notice",
            target="ratio >= 1",
            passed=lambda v, ratio: ratio is not None and ratio >= 1.0,
        ),
        row(
            "analytic vs simulated goodput, largest difference",
            100 * diff,
            "pp",
            target="<= 0.5 pp",
            passed=lambda v, _: v <= 0.5,
        ),
        row(
            "plan() time",
            1000 * best_of(lambda: plan(PlanOptions(COST, RESTART, MTBF, notice_s=120.0))),
            "ms",
            target="<= 50 ms",
            passed=lambda v, _: v <= 50.0,
        ),
        row(
            f"simulator speed ({r.preemptions} preemptions, {r.checkpoints} checkpoints)",
            (r.preemptions + r.checkpoints) / sim_s,
            "events/s",
        ),
    ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
