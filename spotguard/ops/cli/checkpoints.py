"""``spotguard ls``, ``verify``, ``pull`` and ``rm``: the checkpoints in a storage URL, through
``spotguard.checkpoint`` (scan, latest, verify, copy, delete)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from spotguard import checkpoint
from spotguard.checkpoint.folders import cleanup
from spotguard.checkpoint.format.manifest import NEWER_FORMAT
from spotguard.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    ConfigError,
    StorageError,
)
from spotguard.storage import Storage, open_storage
from spotguard.storage.timeouts import DEFAULT_TIMEOUT

from ._args import add_json, add_seconds, add_url
from ._output import fail, report
from .cleanup import duration, empty_local, print_hidden, rm_incomplete

UNREADABLE = "unreadable"


def _open(args: argparse.Namespace, url: str) -> Storage:
    """The storage at ``url``, its cloud requests bounded by ``--timeout``."""
    return open_storage(url, timeout=args.timeout)


def _missing_folder(storage: Storage) -> bool:
    """A local storage root that does not exist (a cloud prefix has no existence of its own)."""
    root = getattr(storage, "root", None)
    if root is None:
        return False
    try:
        os.stat(root)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # there but unusable (below a file, unreadable): the listing says why
    return False


def cmd_ls(args: argparse.Namespace) -> int:
    root, name = _split_step(args.url)  # URL/step-N: that checkpoint alone, as verify takes it
    storage = _open(args, root)
    if _missing_folder(storage):  # a typo must not look like an empty run
        return fail(args, f"{storage.describe()} does not exist", url=storage.describe())
    infos = [i for i in checkpoint.scan(storage) if name is None or i.name == name]
    if name is not None and not infos:
        return fail(args, f"{storage.describe(name)}: no such checkpoint", url=storage.describe(name))
    # The listing checks manifests and sizes only; contents are read and hashed with --verify.
    verified = {i.name: _problem(storage, i) for i in infos if i.complete} if args.verify else {}
    if args.json:
        for info in infos:
            m = info.manifest
            bad = verified.get(info.name, "")
            print(
                json.dumps(
                    {
                        "step": info.step,
                        "name": info.name,
                        "status": _bad_status(bad) if bad else info.status,
                        "problem": bad or info.problem or None,
                        "verified": (not bad) if info.name in verified else None,
                        "time": m.time if m else None,
                        "reason": m.reason if m else None,
                        "size": m.size if m else None,
                    }
                )
            )
        return 0
    if not infos:
        print(f"no checkpoints in {storage.describe()}")
        print_hidden(storage)
        return 0
    print(f"{'STEP':>10}  {'TIME (UTC)':<19}  {'REASON':<9}  {'SIZE':>10}  STATUS")
    for info in infos:
        m = info.manifest
        when = m.time[:19].replace("T", " ") if m else "-"
        size = f"{m.size / 1e6:.1f} MB" if m else "-"
        if not info.complete:
            status = f"{info.status} ({info.problem})" if info.problem else info.status
        elif not args.verify:
            status = "complete (unverified)"
        else:
            bad = verified[info.name]
            status = f"{_bad_status(bad)} ({bad.removeprefix(UNREADABLE + ': ')})" if bad else "complete (verified)"
        label = f"{info.step}.r{info.revision}" if info.revision else str(info.step)  # a later revision of a step
        print(f"{label:>10}  {when:<19}  {(m.reason if m else '-'):<9}  {size:>10}  {status}")
    if not args.verify and any(i.complete for i in infos):
        print("(unverified: manifest and sizes checked; --verify reads every file and checks its checksum)")
    print_hidden(storage)
    return 0


def _bad_status(problem: str) -> str:
    return UNREADABLE if problem.startswith(f"{UNREADABLE}: ") else "corrupt"


def _problem(storage: Storage, info: checkpoint.CheckpointInfo) -> str:
    """The problem found by reading and hashing every file, or "" when it verifies. A file that cannot
    be read (permissions, the service failing) is ``unreadable: ...``: not corrupt, not verified either."""
    try:
        checkpoint.verify(storage, info)
    except (CheckpointCorruptError, CheckpointFormatError) as e:
        text = str(e)  # printed after the checkpoint's name: not twice
        return text[len(info.name) + 2 :] if text.startswith(f"{info.name}: ") else text
    except (StorageError, OSError) as e:
        return f"{UNREADABLE}: {e}"
    return ""


def _split_step(url: str) -> tuple[str, str | None]:
    """``URL/step-NNNNNNNN`` -> (URL, that checkpoint's name); any other URL -> (URL, None)."""
    head, _, last = url.rstrip("/").rpartition("/")
    if head and checkpoint.parse_step_dir(last) is not None:
        return head, last
    return url, None


def cmd_verify(args: argparse.Namespace) -> int:
    root, name = _split_step(args.url)
    storage = _open(args, root)
    infos = [i for i in checkpoint.scan(storage) if name is None or i.name == name]
    if name is not None and not infos:
        return fail(args, f"{storage.describe(name)}: no such checkpoint", url=storage.describe(name))
    if not infos:  # a wrong path or an empty one must not look like a clean bill of health
        root_dir = getattr(storage, "root", None)
        missing = " (it does not exist)" if root_dir is not None and not root_dir.exists() else ""
        return fail(args, f"no checkpoints in {storage.describe()}{missing}: nothing to verify", url=storage.describe())
    bad = 0
    for info in infos:
        problem = _problem(storage, info)
        if not problem:
            status, text = "ok", f"{info.name}: ok"
        elif info.status == "incomplete" and name is None:
            status, text = "incomplete", f"{info.name}: incomplete (ignored by resume)"
        elif info.status == NEWER_FORMAT:  # cannot be checked here; resume refuses it too
            bad += 1
            status, text = NEWER_FORMAT, f"{info.name}: NEWER FORMAT: {problem}"
        elif problem.startswith(f"{UNREADABLE}: "):
            bad += 1
            problem = problem[len(UNREADABLE) + 2 :]
            status, text = UNREADABLE, f"{info.name}: UNREADABLE: {problem}"
        else:
            bad += 1
            status, text = "corrupt", f"{info.name}: CORRUPT: {problem}"
        report(
            args,
            text,
            {
                "url": storage.describe(info.name),
                "name": info.name,
                "step": info.step,
                "status": status,
                "problem": problem or None,
            },
        )
    if not bad and all(i.status == "incomplete" for i in infos):  # nothing was verified: no clean bill
        return fail(args, f"no complete checkpoint in {storage.describe()}: nothing verified", url=storage.describe())
    return 1 if bad else 0


def _find(storage: Storage, step: int | None) -> checkpoint.CheckpointInfo | None:
    """The checkpoint of ``step`` (any status; its highest revision), or the newest complete one without a
    step (``CheckpointFormatError`` when a newer spotguard wrote the newest)."""
    if step is None:
        return checkpoint.latest(storage)
    return next((i for i in reversed(checkpoint.scan(storage)) if i.step == step), None)


def _progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on a terminal; a no-op object otherwise (quiet in logs and pipes)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def cmd_pull(args: argparse.Namespace) -> int:
    """Copy one checkpoint (verified) into DEST/step-N/, a local checkpoint root spotguard can resume from."""
    storage = _open(args, args.url)
    info = _find(storage, args.step)
    if info is None:
        what = "no complete checkpoint" if args.step is None else f"no checkpoint of step {args.step}"
        return fail(args, f"{what} in {storage.describe()}", url=storage.describe())
    if not info.complete or info.manifest is None:
        return fail(
            args, f"{storage.describe(info.name)} is {info.status}: {info.problem}", url=storage.describe(info.name)
        )
    dest = _open(args, args.dest)
    where = dest.describe(info.name)
    if dest.list(info.name + "/"):
        return fail(args, f"{where} already exists", url=where)
    bar = _progress_bar(info.manifest.size, info.name)
    counts = hasattr(storage, "progress")  # cloud backends report the bytes they download
    if counts:
        storage.progress = bar.update  # type: ignore[attr-defined]
    try:
        checkpoint.copy(storage, dest, info, verify=True)
        if not counts:
            bar.update(info.manifest.size)
    except CheckpointExistsError as e:  # another writer committed this step there meanwhile: its, not ours to delete
        return fail(args, f"cannot pull {storage.describe(info.name)} into {where}: {e}; left as it is", url=where)
    except (OSError, StorageError) as e:  # a folder that cannot be written, a file that cannot be read
        _remove_partial(dest, info.name)
        return fail(args, f"cannot pull {storage.describe(info.name)} into {where}: {e}", url=where)
    finally:
        bar.close()
    report(
        args,
        f"{where}: pulled step {info.step} ({info.manifest.size / 1e6:.1f} MB, verified)",
        {
            "url": where,
            "source": storage.describe(info.name),
            "step": info.step,
            "name": info.name,
            "size": info.manifest.size,
            "verified": True,
        },
    )
    return 0


def _remove_partial(dest: Storage, name: str) -> None:
    """What a failed pull wrote: never left to look like a checkpoint being written (a retry would
    find it "already exists")."""
    try:
        checkpoint.delete(dest, name)
    except (OSError, StorageError) as e:
        print(f"spotguard: could not remove the partial copy {dest.describe(name)}: {e}", file=sys.stderr)


def cmd_rm(args: argparse.Namespace) -> int:
    if args.step is not None and args.min_age is not None:  # an age filter on a named checkpoint would only hide it
        raise ConfigError("--min-age goes with --incomplete: --step deletes that checkpoint whatever its age")
    if empty_local(args.url):
        return fail(
            args,
            f"{args.url!r} names no folder (it would mean the current directory): give the run's checkpoint root",
            url=args.url,
        )
    storage = _open(args, args.url)
    if _missing_folder(storage):  # a typo must not look like a clean run (as ls)
        return fail(args, f"{storage.describe()} does not exist", url=storage.describe())
    if args.step is None:
        args.min_age = cleanup.DEFAULT_MIN_AGE_S if args.min_age is None else args.min_age
        return rm_incomplete(args, storage)
    # Every revision of the step (step-N/, step-N.rK/), newest first: one left behind, superseded or not,
    # would be that step's checkpoint again (a final save that was cut before its prune leaves two).
    found = [i for i in reversed(checkpoint.scan(storage)) if i.step == args.step]
    if not found:
        return fail(args, f"no checkpoint of step {args.step} in {storage.describe()}", url=storage.describe())
    verb = "would delete" if args.dry_run else "deleted"
    for info in found:
        if not args.dry_run:
            checkpoint.delete(storage, info.name)
        report(
            args,
            f"{verb} {storage.describe(info.name)} ({info.status})",
            {
                verb.replace(" ", "_"): storage.describe(info.name),
                "step": info.step,
                "status": info.status,
                "problem": info.problem or None,
            },
        )
    return 0


def _add_timeout(p: argparse.ArgumentParser) -> None:
    add_seconds(
        p,
        "--timeout",
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up on a cloud storage operation after about this long: each request waits at most this "
        f"long to connect and for each read, and no retry starts after it (default {DEFAULT_TIMEOUT:g})",
    )


def register(sub: Any) -> None:
    """Add ``ls``, ``verify``, ``pull`` and ``rm`` to the ``spotguard`` subcommands."""
    p = sub.add_parser("ls", help="list the checkpoints under a storage URL")
    add_url(p, "a path, file://, s3://, gs:// or az:// URL")
    add_json(p, "one JSON object per line")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every file and check its checksum (default: manifests and sizes only; contents unverified)",
    )
    _add_timeout(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify",
        help="check checkpoints against their manifests (exit 1 when corrupt, of a newer spotguard's format, "
        "or when there is nothing to verify)",
    )
    add_url(p, "storage URL, or URL/step-NNNNNNNN for one checkpoint")
    add_json(
        p,
        "one JSON object per checkpoint (status ok, corrupt, incomplete or "
        "newer-format); an error object and exit 1 when there is nothing to verify",
    )
    _add_timeout(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("pull", help="copy a checkpoint (verified) to a local directory")
    add_url(p)
    p.add_argument("dest", help="local checkpoint root; the checkpoint lands in DEST/step-NNNNNNNN/")
    p.add_argument("--step", type=int, help="which step (default: the newest complete checkpoint)")
    add_json(p, "one JSON object: the pulled checkpoint, or an error")
    _add_timeout(p)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("rm", help="delete one checkpoint, or the leftovers of interrupted saves")
    add_url(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="delete the checkpoint of this step (manifest first)")
    what.add_argument(
        "--incomplete",
        action="store_true",
        help="delete the garbage of killed saves: step-N folders without a manifest, checkpoints whose manifest "
        "names a missing file, spotguard's own temp files, scratch folders, unfinished uploads and upload parts "
        "in the run's folders. Skips (and says so) everything while a run holds a live lease, and anything "
        "changed less than --min-age ago",
    )
    p.add_argument(
        "--min-age",
        type=duration,
        metavar="AGE",
        help="with --incomplete: leave what changed less than AGE ago (seconds, or 30m, 2h, 1d; default 1h), "
        "which a save may still be writing",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    add_json(p, "one JSON object per thing deleted or skipped, or an error")
    _add_timeout(p)
    p.set_defaults(func=cmd_rm)
