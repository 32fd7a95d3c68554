"""The ``spotguard`` command: thin argument parsing over the library.

Each module holds a group of subcommands, each parser next to its handler: ``checkpoints`` (ls,
verify, pull, rm), ``plan``, ``run`` (run, watch), ``mock`` (mock-metadata,
simulate-preemption) and ``rehearse``. A handler returns the exit code; a ``SpotguardError`` it raises is printed as
``spotguard: error: ...`` with exit code 2. Logging is configured here (a library never configures
handlers). Nothing imported at startup needs torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from spotguard._version import __version__
from spotguard.errors import SpotguardError

from . import checkpoints, mock, plan, rehearse, run

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotguard",
        description="Keep PyTorch training alive on spot machines: checkpoints, rehearsals and a supervisor.",
    )
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (checkpoints, plan, run, mock, rehearse):
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except SpotguardError as e:
        print(f"spotguard: error: {e}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "exit_code": 2, "type": type(e).__name__}))
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
