"""``spotguard rm --incomplete`` and the ``hidden:`` line of ``ls``: the garbage of killed saves, through
``spotguard.checkpoint.folders.cleanup`` (which decides what may go), reported one line or document per candidate."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from spotguard.checkpoint import lease
from spotguard.checkpoint.folders import cleanup
from spotguard.checkpoint.format.manifest import human_duration
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError, ConfigError, StorageError
from spotguard.storage import Storage

from ._output import fail, report

_HIDDEN_NAMES = {  # kind -> (one, several)
    "upload part": ("unfinished upload part", "unfinished upload parts"),
    "multipart upload": ("unfinished multipart upload", "unfinished multipart uploads"),
    "temp file": ("temp file", "temp files"),
    "scratch folder": ("scratch folder", "scratch folders"),
    "empty folder": ("empty checkpoint folder", "empty checkpoint folders"),
}


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def print_hidden(storage: Storage) -> None:
    """One line for what saves in flight or killed left that the listing hides (it is billed all the same)."""
    try:
        items = storage.leftovers()
    except StorageError as e:  # e.g. no permission to list multipart uploads: the listing still stands
        print(f"spotguard: cannot count unfinished uploads: {e}", file=sys.stderr)
        return
    if not items:
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[item.kind] = counts.get(item.kind, 0) + 1
    what = ", ".join(f"{n} {_HIDDEN_NAMES.get(kind, (kind, kind))[n > 1]}" for kind, n in counts.items())
    print(
        f"hidden: {what}, {_bytes(sum(item.size for item in items))}; `spotguard rm --incomplete` removes them "
        f"(those not changed for --min-age, {cleanup.DEFAULT_MIN_AGE_S / 3600:g} h by default, while no run holds the lease)"
    )


def empty_local(url: str) -> bool:
    """An empty path, or ``file://`` with none: local storage would take it as the current directory."""
    return not (url[len("file://") :] if url.startswith("file://") else url).strip()


def rm_incomplete(args: argparse.Namespace, storage: Storage) -> int:
    """Delete the garbage of killed saves that no running save can own (``checkpoint.folders.cleanup``)."""
    try:
        found = cleanup.plan(storage, args.min_age)
    except (CheckpointCorruptError, CheckpointFormatError) as e:  # the lease record: is a run writing? unknown
        return fail(args, f"{e}; nothing deleted (delete {lease.LEASE} if no job writes here)", url=storage.describe())
    verb = "would delete" if args.dry_run else "deleted"
    failed = []
    for c in found.garbage:
        why = ""
        if not args.dry_run:
            try:
                why = cleanup.remove(storage, c, found)  # judged again: a job may have committed it since
            except (StorageError, ConfigError, CheckpointCorruptError, CheckpointFormatError) as e:  # stops no other
                failed.append(c)
                report(
                    args,
                    f"could not delete {_name(storage, c)} ({_what(c)}): {_shown(str(e))}",
                    {**_doc(storage, c, "failed"), "error": str(e)},
                )
                continue
        if why:
            found.skipped.append((c, why))
            continue
        report(args, f"{verb} {_name(storage, c)} ({_what(c)})", _doc(storage, c, _KEY[verb]))
    for c, why in found.skipped:
        report(
            args,
            f"skipped {_name(storage, c)} ({_what(c)}): {_shown(why)}",
            {**_doc(storage, c, "skipped"), "why": why},
        )
    if not found.garbage and not found.skipped and not args.json:  # --json: one document per candidate, none here
        print(f"nothing incomplete in {_shown(storage.describe())}")
    if failed:
        return fail(
            args, f"{len(failed)} of {len(found.garbage)} could not be deleted (see above)", 2, url=storage.describe()
        )
    return 0


_KEY = {"deleted": "deleted", "would delete": "would_delete"}


def _name(storage: Storage, c: cleanup.Candidate) -> str:
    return _shown(storage.describe(c.name))


def _shown(text: str) -> str:
    """``text`` with every character that is not printable escaped (``\\n``, ``\\x1b``): a name such as a
    temp file's owner field may hold a newline, which would forge a line of the output."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _what(c: cleanup.Candidate) -> str:
    parts = [f"{c.kind}: {c.problem}" if c.problem else c.kind]
    if c.size is not None:
        parts.append(_bytes(c.size))
    parts.append("age unknown" if c.age_s is None else f"{human_duration(c.age_s)} old")
    return _shown(", ".join(parts))


def _doc(storage: Storage, c: cleanup.Candidate, verb: str) -> dict[str, Any]:
    status = {"incomplete": "incomplete", "broken": "corrupt"}.get(c.kind, "leftover")
    return {
        verb: storage.describe(c.name),
        "step": c.step if c.leftover is None else None,
        "status": status,
        "kind": c.kind,
        "problem": c.problem or None,
        "size": c.size,
        "age_s": None if c.age_s is None else round(c.age_s, 1),
    }


def duration(text: str) -> float:
    """``3600``, ``90s``, ``30m``, ``2h``, ``1d`` -> seconds (argparse type)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value = text.strip().lower()
    scale = units.get(value[-1:], 0)
    try:
        seconds = float(value[:-1] if scale else value) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, or a number with s, m, h or d)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (must be 0 or more)")
    return seconds
