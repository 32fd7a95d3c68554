"""``spotguard run`` (the supervisor, ``spotguard.ops.supervisor``) and ``spotguard watch`` (the
notice watcher alone). Neither imports torch."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from spotguard import redact
from spotguard.errors import SpotguardError
from spotguard.notices.base import Notice

from ._args import add_json, add_seconds, options_from

if TYPE_CHECKING:
    from spotguard.ops.supervisor import SupervisorOptions


#: ``spotguard run``'s arguments for its metrics exporter, not the supervisor's options.
METRICS = ("metrics_port", "metrics_host", "metrics_file")


def options(args: argparse.Namespace) -> SupervisorOptions:
    """The supervisor's options from its parsed arguments (``--json`` also sends the job's output to stderr)."""
    from spotguard.ops.supervisor import SupervisorOptions

    return options_from(SupervisorOptions, args, elsewhere=METRICS, stdout_to_stderr="json")


def cmd_run(args: argparse.Namespace) -> int:
    from spotguard.ops.supervisor import Supervisor

    supervisor = Supervisor(options(args))
    supervisor.stops.hold_after_stop = True  # this process exits with the run's code: a late repeat must not kill it
    exporter = None
    if args.metrics_port is not None or args.metrics_file:
        from spotguard.ops.supervisor.metrics import RunMetrics

        exporter = RunMetrics(supervisor, port=args.metrics_port, host=args.metrics_host, jsonl=args.metrics_file)
    try:
        return supervisor.run()
    except SpotguardError as e:
        if not args.json:
            raise
        print(f"spotguard: error: {redact.redact(str(e), redact.secret_values())}", file=sys.stderr)
        return 2
    finally:
        if exporter is not None:
            exporter.close()
        if args.json:
            print(json.dumps(supervisor.summary()), flush=True)


def cmd_watch(args: argparse.Namespace) -> int:
    from spotguard.watcher import Watcher

    def show(notice: Notice) -> None:
        if args.json:
            print(json.dumps(notice.to_json()), flush=True)
            return
        left = notice.seconds_left()
        print(
            f"{notice.provider}: {notice.kind} notice"
            + (
                f", deadline {notice.deadline.isoformat()} ({left:.0f}s left)"
                if notice.deadline and left is not None
                else ""
            )
            + (" (advisory)" if notice.advisory else ""),
            flush=True,
        )

    watcher = Watcher(args.providers, args.interval, on_notice=show, stop_on_advisory=args.advisory)
    if not args.json:
        print(
            f"watching {', '.join(p.name for p in watcher.providers) or 'nothing'} every {args.interval:g}s",
            file=sys.stderr,
            flush=True,
        )
    try:
        with watcher:
            got = watcher.preempted.wait(args.timeout)
    except KeyboardInterrupt:
        return 130
    return 0 if got else 1


#: ``spotguard run --help``'s description: what its exit code says (what a job scheduler decides on).
EXIT_CODES = (
    "Exit codes: 0 finished, 75 stopped for a notice (do not restart), 78 the job failed on "
    "an error a restart would meet again (a checkpoint no resume can load, a changed data loader), "
    "73 another job writes to the same storage (it holds the run's writer lease, or took it over), "
    "2 restart budget used up, bad options or a newer spotguard's checkpoint, 128+N stopped by signal N "
    "(the job died of it or did not exit in time); after a stop signal, "
    "otherwise the job's own exit code."
)


def register(sub: Any) -> None:
    """Add ``run`` and ``watch`` to the ``spotguard`` subcommands."""
    p = sub.add_parser(
        "run",
        help="run a training command; restart it after a crash or hang, not after a preemption",
        description=EXIT_CODES,
    )
    p.add_argument("--storage", help="checkpoint URL, passed to the job as $SPOTGUARD_STORAGE")
    p.add_argument("--local-dir", help="the job's fast local tier (e.g. NVMe), passed as $SPOTGUARD_LOCAL_DIR")
    p.add_argument(
        "--takeover",
        action="store_true",
        help="take over the storage's writer lease even while another job holds it (that job then "
        "commits nothing more); passed to the job as $SPOTGUARD_TAKEOVER=1",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="copy the newest checkpoint into --local-dir, verified, before starting the job",
    )
    p.add_argument("--max-restarts", type=int, default=10, help="restarts after crashes/hangs (default 10)")
    add_seconds(
        p,
        "--hang-timeout",
        help="seconds without a completed step before the job counts as hung (default: no watchdog)",
    )
    add_seconds(p, "--startup-timeout", help="the same before the first step (default: --hang-timeout)")
    add_seconds(p, "--backoff", default=1.0, help="first restart delay in seconds, doubled each restart")
    add_seconds(p, "--backoff-max", default=60.0, help="longest restart delay (default 60)")
    add_seconds(
        p,
        "--grace",
        default=120.0,
        help="seconds the job gets to checkpoint and exit after a forwarded stop signal (default 120)",
    )
    p.add_argument(
        "--forward-as",
        metavar="SIGNAL",
        help="forward stop signals as this one (e.g. USR1) "
        "where the platform also signals the job directly (Slurm preemption)",
    )
    add_json(
        p,
        "print one JSON document at the end (exit code, outcome, "
        "restarts by cause, every exit); the job's stdout goes to stderr",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics (restarts and their causes) on this port (needs spotguard[metrics])",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address to serve them on (default 127.0.0.1)")
    p.add_argument("--metrics-file", metavar="FILE", help="append one JSON line per start, exit and the end")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- python train.py ...")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "watch",
        help="run the notice watcher alone; exit 0 on a notice",
        description="Prints notices as they arrive and exits 0 on the first stop notice "
        "(or advisory one with --advisory); exit 1 at --timeout.",
    )
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls of each provider (default 1)")
    add_json(p, "one JSON object per notice")
    add_seconds(p, "--timeout", "give up after this many seconds (exit 1)")
    p.add_argument(
        "--advisory",
        action="store_true",
        help="advisory notices (AWS rebalance recommendation, "
        "GCP migrate) end it too, exit 0 (default: they are printed, only stop notices end it)",
    )
    p.set_defaults(func=cmd_watch)
