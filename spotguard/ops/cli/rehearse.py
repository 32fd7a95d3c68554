"""``spotguard rehearse [options] -- COMMAND ...``: the job through N preemptions, measured
(``spotguard.ops.rehearsal``). Exit 0 only when every preemption committed its emergency checkpoint,
the job finished and, with ``--reference``, the result is bit for bit the uninterrupted run's."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.errors import StorageError

from ._args import add_json, add_seconds, options_from

if TYPE_CHECKING:
    from spotguard.ops.rehearsal import RehearsalOptions


#: The options' fields whose arguments have other names (``--mtbf`` fills ``mtbf_s``).
RENAMED = {
    "mtbf_s": "mtbf",
    "source": "notices",
    "lead_s": "lead",
    "replacement_s": "replacement_delay",
    "timeout_s": "timeout",
    "stdout_to_stderr": "json",
}


#: Its arguments for the reference run, the report and the work folder, not the rehearsal's options.
ELSEWHERE = ("reference", "reference_storage", "report", "plot", "work_dir")


def options(args: argparse.Namespace) -> RehearsalOptions:
    """The rehearsal's options from its parsed arguments."""
    from spotguard.ops.rehearsal import RehearsalOptions

    return options_from(RehearsalOptions, args, elsewhere=ELSEWHERE, **RENAMED)


def cmd_rehearse(args: argparse.Namespace) -> int:
    from spotguard.ops import rehearsal

    # A SIGTERM (a CI job's timeout, `kill`) unwinds like Ctrl-C: the fleet kills the job it runs and
    # stops the mock server on its way out, instead of leaving them behind.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    reference = rehearsal.reference_url(args.storage, args.reference_storage) if args.reference else None
    result = rehearsal.rehearse(options(args), args.work_dir, reference)
    doc = result.to_dict()
    if args.plot:
        from spotguard.ops.rehearsal.plot import plot_rehearsal

        plot_rehearsal(result, args.plot)
        doc["plot"] = args.plot
    if args.report:
        try:
            Path(args.report).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        except OSError as e:
            raise StorageError(f"cannot write the report {args.report}: {e}") from e
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        print(rehearsal.table(result.report))
        if result.comparison is not None:
            print(result.comparison.line())
        if args.plot:
            print(f"plot written to {args.plot}")
        print("rehearsal passed" if result.ok else "rehearsal FAILED", file=sys.stderr if not result.ok else sys.stdout)
    return 0 if result.ok else 1


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def register(sub: Any) -> None:
    """Add ``rehearse`` to the ``spotguard`` subcommands."""
    from spotguard.ops.rehearsal.options import SOURCES

    p = sub.add_parser(
        "rehearse",
        help="run a job through N preemptions on a local fleet; measure each one, goodput and exactness",
        description="Run COMMAND as a fleet of spot machines would: notices at random moments, the job "
        "killed at each notice's deadline, a replacement started after each preemption. Prints what each "
        "preemption cost and the goodput beside the planner's prediction.",
    )
    p.add_argument("--preemptions", "-n", type=_positive_int, default=5, help="notices to send (default 5)")
    add_seconds(p, "--mtbf", default=30.0, metavar="S", help="mean seconds of training between notices (default 30)")
    p.add_argument("--seed", type=int, help="seed of the notice moments (default: a new draw each time)")
    p.add_argument(
        "--notices",
        choices=SOURCES,
        default="aws",
        help="where notices come from: a mock metadata service (default aws; gcp, azure), a SIGTERM, a notice file",
    )
    add_seconds(
        p,
        "--lead",
        metavar="S",
        help="seconds from a notice to the machine's end (default: the cloud's, 30 s else)",
    )
    add_seconds(
        p,
        "--replacement-delay",
        default=1.0,
        metavar="S",
        help="a machine's end to the next start (default 1)",
    )
    p.add_argument(
        "--after-restart",
        type=_positive_int,
        default=0,
        metavar="K",
        help="K of the notices come within 3 s of a later machine's start instead (K < N)",
    )
    p.add_argument(
        "--during-save",
        type=_positive_int,
        default=0,
        metavar="K",
        help="K of the notices wait for the job's next save in flight (default 0)",
    )
    p.add_argument(
        "--during-eval",
        type=_positive_int,
        default=0,
        metavar="K",
        help="K of the notices wait for the job's next evaluation (guard.evaluation(), a trainer's; default 0)",
    )
    p.add_argument(
        "--storage",
        help="the job's checkpoint URL: $SPOTGUARD_STORAGE and {storage} in COMMAND (default: the job's own)",
    )
    p.add_argument(
        "--fresh-local",
        action="store_true",
        help="each machine gets a new empty local folder ($SPOTGUARD_LOCAL_DIR, $TMPDIR, {local}): only the storage survives",
    )
    p.add_argument("--reference", action="store_true", help="also run COMMAND uninterrupted and compare bit for bit")
    p.add_argument(
        "--reference-storage", metavar="URL", help="the reference run's storage (default: STORAGE.reference)"
    )
    p.add_argument("--report", metavar="FILE.json", help="write the full report as JSON")
    add_json(p, "print the report as one JSON document instead of the table")
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw steps over time, preemptions and time lost (spotguard[plot])"
    )
    p.add_argument(
        "--work-dir", metavar="DIR", help="keep heartbeats and the Guard's events here (default: a temp dir)"
    )
    add_seconds(p, "--timeout", "give up after this many seconds", metavar="S")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    p.set_defaults(func=cmd_rehearse)
