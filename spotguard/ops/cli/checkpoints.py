"""``spotguard ls``, ``verify``, ``pull`` and ``rm``: the checkpoints in a storage URL, through
``spotguard.checkpoint`` (scan, latest, verify, copy, delete)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spotguard import checkpoint
from spotguard.checkpoint.manifest import NEWER_FORMAT
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError
from spotguard.storage import Storage, open_storage

from ._output import fail, report

_URL = "storage URL (path, file://, s3://, gs://, az://)"


def cmd_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    infos = checkpoint.scan(storage)
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
                        "status": "corrupt" if bad else info.status,
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
            status = f"corrupt ({verified[info.name]})" if verified[info.name] else "complete (verified)"
        print(f"{info.step:>10}  {when:<19}  {(m.reason if m else '-'):<9}  {size:>10}  {status}")
    if not args.verify and any(i.complete for i in infos):
        print("(unverified: manifest and sizes checked; --verify reads every file and checks its checksum)")
    return 0


def _problem(storage: Storage, info: checkpoint.CheckpointInfo) -> str:
    """The problem found by reading and hashing every file, or "" when it verifies."""
    try:
        checkpoint.verify(storage, info)
    except (CheckpointCorruptError, CheckpointFormatError) as e:
        text = str(e)  # printed after the checkpoint's name: not twice
        return text[len(info.name) + 2 :] if text.startswith(f"{info.name}: ") else text
    return ""


def _split_step(url: str) -> tuple[str, str | None]:
    """``URL/step-NNNNNNNN`` -> (URL, that checkpoint's name); any other URL -> (URL, None)."""
    head, _, last = url.rstrip("/").rpartition("/")
    if head and checkpoint.parse_step_dir(last) is not None:
        return head, last
    return url, None


def cmd_verify(args: argparse.Namespace) -> int:
    root, name = _split_step(args.url)
    storage = open_storage(root)
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
    return 1 if bad else 0


def _find(storage: Storage, step: int | None) -> checkpoint.CheckpointInfo | None:
    """The checkpoint of ``step`` (any status), or the newest complete one without a step
    (``CheckpointFormatError`` when a newer spotguard wrote the newest)."""
    if step is None:
        return checkpoint.latest(storage)
    return next((i for i in checkpoint.scan(storage) if i.step == step), None)


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
    storage = open_storage(args.url)
    info = _find(storage, args.step)
    if info is None:
        what = "no complete checkpoint" if args.step is None else f"no checkpoint of step {args.step}"
        return fail(args, f"{what} in {storage.describe()}", url=storage.describe())
    if not info.complete or info.manifest is None:
        return fail(
            args, f"{storage.describe(info.name)} is {info.status}: {info.problem}", url=storage.describe(info.name)
        )
    dest = open_storage(args.dest)
    if dest.list(info.name + "/"):
        return fail(args, f"{dest.describe(info.name)} already exists", url=dest.describe(info.name))
    bar = _progress_bar(info.manifest.size, info.name)
    counts = hasattr(storage, "progress")  # cloud backends report the bytes they download
    if counts:
        storage.progress = bar.update  # type: ignore[attr-defined]
    try:
        checkpoint.copy(storage, dest, info, verify=True)
        if not counts:
            bar.update(info.manifest.size)
    finally:
        bar.close()
    where = dest.describe(info.name)
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


def cmd_rm(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    if args.step is not None:
        info = _find(storage, args.step)
        if info is None:
            return fail(args, f"no checkpoint of step {args.step} in {storage.describe()}", url=storage.describe())
        doomed = [info]
    else:
        doomed = [i for i in checkpoint.scan(storage) if i.status == "incomplete"]
    for info in doomed:
        checkpoint.delete(storage, info.name)
        why = f"incomplete: {info.problem}" if args.step is None else info.status
        report(
            args,
            f"deleted {storage.describe(info.name)} ({why})",
            {
                "deleted": storage.describe(info.name),
                "step": info.step,
                "status": info.status,
                "problem": info.problem or None,
            },
        )
    if args.step is not None:
        return 0
    cleanup = getattr(storage, "remove_temp_files", None) or getattr(storage, "abort_incomplete_uploads", None)
    leftovers = cleanup() if cleanup else []
    for name in leftovers:
        report(args, f"deleted leftover {name}", {"deleted": name, "step": None, "status": "leftover", "problem": None})
    if not doomed and not leftovers and not args.json:  # --json: one document per deletion, none here
        print(f"nothing incomplete in {storage.describe()}")
    return 0


def register(sub: Any) -> None:
    """Add ``ls``, ``verify``, ``pull`` and ``rm`` to the ``spotguard`` subcommands."""
    p = sub.add_parser("ls", help="list the checkpoints under a storage URL")
    p.add_argument("url", help="a path, file://, s3://, gs:// or az:// URL")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every file and check its checksum (default: manifests and sizes only; contents unverified)",
    )
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify",
        help="check checkpoints against their manifests (exit 1 when corrupt, of a newer spotguard's format, "
        "or when there is nothing to verify)",
    )
    p.add_argument("url", help="storage URL, or URL/step-NNNNNNNN for one checkpoint")
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per checkpoint (status ok, corrupt, incomplete or "
        "newer-format); an error object and exit 1 when there is nothing to verify",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("pull", help="copy a checkpoint (verified) to a local directory")
    p.add_argument("url", help=_URL)
    p.add_argument("dest", help="local checkpoint root; the checkpoint lands in DEST/step-NNNNNNNN/")
    p.add_argument("--step", type=int, help="which step (default: the newest complete checkpoint)")
    p.add_argument("--json", action="store_true", help="one JSON object: the pulled checkpoint, or an error")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("rm", help="delete one checkpoint, or the leftovers of interrupted saves")
    p.add_argument("url", help=_URL)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="delete the checkpoint of this step (manifest first)")
    what.add_argument(
        "--incomplete", action="store_true", help="delete checkpoints without a manifest and unfinished uploads"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per thing deleted, or an error")
    p.set_defaults(func=cmd_rm)
