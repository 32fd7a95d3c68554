"""``spotguard plan``: how often to checkpoint, from costs given or measured (``spotguard.planner``)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from spotguard import planner
from spotguard.errors import ConfigError


def _minutes(seconds: float | None) -> str:
    if seconds is None or math.isinf(seconds):
        return "-" if seconds is None else "unbounded"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 36000 else f"{seconds / 3600:.1f} h"


def options(args: argparse.Namespace) -> tuple[planner.PlanOptions, list[str]]:
    """The planner's options from the flags, a ``--stats`` file filling in what they leave out; and the
    figures assumed where neither says (a first run's metrics file measured no restart)."""
    from spotguard.costs import DEFAULT_START_S, MeasuredCosts, load_stats

    measured = load_stats(args.stats) if args.stats else MeasuredCosts(None, None, None, None)
    cost = args.checkpoint_cost if args.checkpoint_cost is not None else measured.checkpoint_s
    save = args.save_time if args.save_time is not None else measured.save_s
    restart = args.restart_cost if args.restart_cost is not None else measured.restart_s
    assumed = []
    if restart is None and args.stats:  # a first run's metrics file: nothing was resumed, so no restore measured
        restart = DEFAULT_START_S
        assumed.append(
            f"restart cost {DEFAULT_START_S:g} s: {args.stats} measured no restore (nothing was resumed yet), so "
            "only starting Python, torch and the loaders is counted; --restart-cost sets it"
        )
    if cost is None or restart is None:
        missing = " and ".join(f for f, v in (("--checkpoint-cost", cost), ("--restart-cost", restart)) if v is None)
        where = f"{args.stats} measured no checkpoint" if args.stats else "or a --stats file with it"
        raise ConfigError(f"give {missing} ({where})")
    notice = args.notice if args.notice is not None else planner.NOTICE_LEAD_S.get(args.cloud or "")
    try:
        intervals = [float(v) for v in args.intervals.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--intervals takes seconds separated by commas, got {args.intervals!r}") from e
    return (
        planner.PlanOptions(
            cost,
            restart,
            args.mtbf,
            notice_s=notice,
            notice_share=args.notice_share,
            job_hours=args.job_hours,
            intervals_s=intervals,
            state_gb=args.state_gb if args.state_gb is not None else measured.state_gb,
            deadline_policy=args.deadline_policy,
            save_s=save,
            window_margin_s=args.window_margin,
        ),
        assumed,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    opts, assumed = options(args)
    plan = planner.plan(opts)
    if args.plot:
        from spotguard.ops.plot import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps({**plan.to_dict(), "plot": args.plot, "assumed": assumed}, allow_nan=False))
        return 0
    head = f"checkpoint {opts.checkpoint_s:g} s, restart {opts.restart_s:g} s, MTBF {opts.mtbf_hours:g} h"
    if opts.notice_s is not None:
        head += f"; a notice {opts.notice_s:g} s ahead for {100 * (opts.notice_share or 0):.0f}% of preemptions"
        if not opts.notice_works:
            head += " (too short to write a checkpoint: ignored)"
    print(head)
    for note in assumed:
        print(f"assumed: {note}")
    if opts.notice_works:
        print(
            f"deadline policy {opts.deadline_policy}: per noticed preemption {plan.window_s:.0f} s of the notice "
            f"trained and kept, {plan.idle_s:.0f} s paid and idle (save {opts.save_s:g} s"
            + (f", margin {opts.window_margin_s:g} s)" if opts.deadline_policy == "use-window" else ")")
            + ", then the restart"
        )
    if not opts.notice_works:
        scope = "every preemption"
    elif math.isinf(plan.effective_mtbf_s):
        scope = "no preemption: every one comes with a notice, so the interval is the job length"
    else:
        scope = f"the preemptions without notice (effective MTBF {plan.effective_mtbf_s / 3600:.1f} h)"
    print(
        f"Young sqrt(2*C*MTBF) = {_minutes(plan.young_s)}, Daly = {_minutes(plan.daly_s)} "
        f"(best under the model: {_minutes(plan.optimum_s)}), covering {scope}"
    )
    gb = opts.state_gb is not None
    print(
        f"\n{'STRATEGY':<26}{'INTERVAL':>10}{'GOODPUT':>9}{'LOST/PREEMPTION':>17}{'CKPT/H':>8}"
        + (f"{'GB/H':>8}" if gb else "")
    )
    for r in plan.rows:
        print(
            f"{r.name:<26}{_minutes(r.interval_s):>10}{100 * r.goodput:>8.1f}%{_minutes(r.lost_work_s):>17}"
            f"{r.checkpoints_per_hour:>8.2f}" + (f"{r.write_gb_per_hour:>8.1f}" if gb else "")
        )
    how = ""
    if opts.notice_works:
        how = " plus an emergency checkpoint on notice" + (
            ", training on in the notice window" if plan.window_s > 0 else ""
        )
    if plan.interval_s <= opts.min_interval_s * 1.000001:
        how += f" (not below the {opts.min_interval_s:g} s a save takes to commit)"
    print(
        f"\nrecommendation: checkpoint every {_minutes(plan.interval_s)}"
        + (f" ({plan.interval_s:.0f} s)" if plan.interval_s >= 60 else "")
        + f"{how}: "
        f"goodput {100 * plan.goodput:.1f}%, ~{_minutes(plan.lost_work_s)} of work lost per preemption "
        f"(job of {opts.job_hours:g} h for the no-checkpoint row)"
    )
    if plan.goodput <= 0.0:  # every interval's row reads 0%: say why rather than leave a "best" that is none
        print(
            f"no interval makes progress: a restart of {opts.restart_s:g} s against an MTBF of "
            f"{opts.mtbf_hours * 3600:g} s is rarely over before the next preemption; make restarts cheaper "
            "(a local tier, a warm pool of machines) or find capacity preempted less often"
        )
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def register(sub: Any) -> None:
    """Add ``plan`` to the ``spotguard`` subcommands."""
    p = sub.add_parser("plan", help="how often to checkpoint: interval, goodput and lost work per strategy")
    p.add_argument("--checkpoint-cost", type=float, metavar="S", help="seconds the loop is blocked per checkpoint")
    p.add_argument("--restart-cost", type=float, metavar="S", help="seconds from a preemption to training again")
    p.add_argument("--mtbf", type=float, required=True, metavar="H", help="mean hours between preemptions")
    p.add_argument(
        "--notice",
        type=float,
        metavar="S",
        help="seconds of notice before a preemption (default: no notice, plain Young/Daly)",
    )
    p.add_argument(
        "--notice-share",
        type=float,
        metavar="F",
        help=f"share of preemptions that come with the notice (default {planner.DEFAULT_NOTICE_SHARE} "
        f"with --notice; alone it assumes a {planner.DEFAULT_NOTICE_S:g} s notice)",
    )
    p.add_argument("--cloud", choices=sorted(planner.NOTICE_LEAD_S), help="the notice lead of this cloud")
    p.add_argument(
        "--deadline-policy",
        choices=planner.DEADLINE_POLICIES,
        default="stop",
        help="the guard's deadline_policy: stop at the notice (the rest of the lead is idle), or use-window "
        "(train on and checkpoint again before the deadline); default stop, as the Guard",
    )
    p.add_argument(
        "--save-time",
        type=float,
        metavar="S",
        help="seconds to commit one checkpoint to durable storage: the emergency save, and the shortest "
        "interval (default: write_s + upload_s of --stats, else the checkpoint cost)",
    )
    p.add_argument(
        "--window-margin",
        type=float,
        default=planner.DEFAULT_WINDOW_MARGIN_S,
        metavar="S",
        help=f"use-window: seconds kept free before the deadline beyond the save (default "
        f"{planner.DEFAULT_WINDOW_MARGIN_S:g}, as the Guard's window_margin)",
    )
    p.add_argument("--job-hours", type=float, default=24.0, metavar="H", help="job length (default 24)")
    p.add_argument("--state-gb", type=float, metavar="G", help="checkpoint size, to report GB written per hour")
    p.add_argument(
        "--intervals",
        default=",".join(f"{v:g}" for v in planner.DEFAULT_INTERVALS_S),
        metavar="S,S,...",
        help="fixed intervals to compare, in seconds",
    )
    p.add_argument(
        "--stats",
        metavar="FILE",
        help="measured costs: records of json.dumps(guard.stats().as_dict()), "
        "a JSON object, list or lines; restart cost = restore_s + 60 s of start unless restart_s is given",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw goodput vs interval (needs spotguard[plot])")
    p.set_defaults(func=cmd_plan)
