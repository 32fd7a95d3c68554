"""The ``spotguard`` command: thin argument parsing over the library.

Each module holds a group of subcommands, each parser next to its handler: ``checkpoints`` (ls,
verify, pull, rm), ``plan``, ``run`` (run, watch), ``mock`` (mock-metadata, simulate-preemption) and
``rehearse``. A handler returns the exit code; a ``SpotguardError`` (or an ``OSError``: a file it
cannot read or write) it raises is printed as ``spotguard: error: ...`` with exit code 2. Logging is
configured here (a library never configures handlers): one stderr handler whose ``RedactingFilter``
masks credentials in every record, the cloud SDKs' included; their wire logs (every request and
header) only from ``-vvv``. Nothing imported at startup needs torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
from collections.abc import Sequence

from spotguard import redact
from spotguard._version import __version__
from spotguard.errors import SpotguardError

from . import checkpoints, mock, plan, rehearse, run

__all__ = ["build_parser", "main"]

#: Loggers of the SDKs that log each request on the wire at DEBUG: capped at INFO below -vvv.
WIRE_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "requests", "azure", "google", "msal")


VERBOSE = (
    "more logging (before or after the command): -v info, -vv debug, -vvv also the cloud SDKs' requests "
    "(secrets are masked); warnings only without it"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotguard",
        description="Keep PyTorch training alive on spot machines: checkpoints, rehearsals and a supervisor.",
    )
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help=VERBOSE,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (checkpoints, plan, run, mock, rehearse):
        group.register(sub)
    for command in sub.choices.values():  # `spotguard ls -v DIR` as `spotguard -v ls DIR`: users type both
        command.add_argument(
            "-v", "--verbose", action="count", dest="verbose_after", default=argparse.SUPPRESS, help=VERBOSE
        )
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; an unknown one is the subcommand's error (its usage, and the option meant), not the
    top-level parser's, which would print only ``spotguard [-h] [--version] [-v] COMMAND ...``."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        command = sub.choices[args.command]
        known = [o for a in command._actions for o in a.option_strings]
        options = [x.split("=")[0] for x in extra if x.startswith("--")]
        misplaced = [x for x in options if x in known]  # `spotguard --json ls`: the command's, before it
        if misplaced:
            command.error(f"{', '.join(misplaced)}: an option of `spotguard {args.command}`: give it after the command")
        hints = [m for x in options for m in difflib.get_close_matches(x, known, 1)]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def configure_logging(verbose: int) -> None:
    """Root at WARNING / INFO / DEBUG for 0 / 1 / 2+ ``-v``; the SDKs' wire loggers at most INFO below 3.

    A level set on a logger replaces the root's for its records: the SDKs get the root's level, capped
    at INFO, or their INFO lines ("Found credentials ...") would show without ``-v``."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact.install()
    for name in WIRE_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.INFO) if verbose < 3 else logging.NOTSET)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    args.verbose += getattr(args, "verbose_after", 0)  # -v before the command and after it count together
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except (SpotguardError, OSError) as e:
        # OSError: a file or folder the command cannot read or write; said in one line, never a traceback
        logging.getLogger("spotguard.ops.cli").debug("the error in full", exc_info=True)
        message = redact.redact(str(e), redact.secret_values())
        print(f"spotguard: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": message, "exit_code": 2, "type": type(e).__name__}))
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
