"""Argument kinds that recur across the subcommands, declared once so that they parse alike everywhere:
a ``--json`` flag (what ``_output.report`` reads), a storage URL positional, an option in seconds, and
the training command given after ``--``."""

from __future__ import annotations

import argparse

#: The help of a storage URL positional where nothing more needs saying.
URL = "storage URL (path, file://, s3://, gs://, az://)"


def add_json(p: argparse.ArgumentParser, help: str) -> None:
    """``--json``: answer in JSON documents instead of text; ``help`` says which documents."""
    p.add_argument("--json", action="store_true", help=help)


def add_url(p: argparse.ArgumentParser, help: str = URL) -> None:
    """The positional ``url`` of the storage (or checkpoint) a command works on."""
    p.add_argument("url", help=help)


def add_seconds(
    p: argparse.ArgumentParser, flag: str, help: str, *, default: float | None = None, metavar: str | None = None
) -> None:
    """An option of a duration in seconds (a float; None when not given and without ``default``)."""
    p.add_argument(flag, type=float, default=default, metavar=metavar, help=help)


def command(args: argparse.Namespace) -> list[str]:
    """``args.cmd`` (an ``argparse.REMAINDER``) without the ``--`` that argparse keeps in front of it."""
    return args.cmd[1:] if args.cmd[:1] == ["--"] else list(args.cmd)
