"""Argument kinds that recur across the subcommands, declared once so that they parse alike everywhere:
a ``--json`` flag (what ``_output.report`` reads), a storage URL positional, an option in seconds, and
the training command given after ``--``, and an options dataclass filled from them."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")

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


#: What every subcommand's namespace holds besides its options: the parser's own (``cli/__init__.py``).
PARSER_OWN = frozenset({"command", "func", "verbose", "verbose_after", "cmd"})


def options_from(cls: type[T], args: argparse.Namespace, *, elsewhere: Iterable[str] = (), **renamed: str) -> T:
    """``cls``, an options dataclass, from ``args``: ``command`` from the remainder, every other field
    from the argument of its name or of the name ``renamed`` gives it (``lead_s="lead"``); a field no
    argument sets keeps its default. Every argument must fill a field or be named in ``elsewhere`` (the
    subcommand uses it itself), so an option cannot be parsed and then dropped: a TypeError otherwise."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    wrong = {k: v for k, v in renamed.items() if k not in fields or not hasattr(args, v)}
    names = {field: renamed.get(field, field) for field in fields - {"command"}}
    dropped = set(vars(args)) - set(names.values()) - PARSER_OWN - set(elsewhere)
    if wrong or dropped:
        raise TypeError(f"options_from({cls.__name__}): no such field or argument: {wrong}; used nowhere: {dropped}")
    values: dict[str, Any] = {field: getattr(args, name) for field, name in names.items() if hasattr(args, name)}
    values["command"] = command(args)
    return cls(**values)
