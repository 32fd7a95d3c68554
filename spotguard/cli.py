"""The ``spotguard`` command: thin argument parsing over the library.

Each subcommand is one ``_cmd_*`` function registered in ``build_parser()``; it returns the exit
code. Logging is configured here (a library never configures handlers).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Sequence

from . import __version__, checkpoint
from .errors import CheckpointCorruptError, SpotguardError
from .storage import open_storage

logger = logging.getLogger("spotguard.cli")


def _cmd_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    infos = checkpoint.scan(storage)
    if args.json:
        for info in infos:
            m = info.manifest
            print(json.dumps({"step": info.step, "name": info.name, "status": info.status,
                              "problem": info.problem or None, "time": m.time if m else None,
                              "reason": m.reason if m else None, "size": m.size if m else None}))
        return 0
    if not infos:
        print(f"no checkpoints in {storage.describe()}")
        return 0
    print(f"{'STEP':>10}  {'TIME (UTC)':<19}  {'REASON':<9}  {'SIZE':>10}  STATUS")
    for info in infos:
        m = info.manifest
        when = m.time[:19].replace("T", " ") if m else "-"
        size = f"{m.size / 1e6:.1f} MB" if m else "-"
        status = info.status + (f" ({info.problem})" if info.problem and info.status != "complete" else "")
        print(f"{info.step:>10}  {when:<19}  {(m.reason if m else '-'):<9}  {size:>10}  {status}")
    return 0


def _split_step(url: str) -> tuple[str, str | None]:
    head, _, last = url.rstrip("/").rpartition("/")
    if head and checkpoint.parse_step_dir(last) is not None:
        return head, last
    return url, None


def _cmd_verify(args: argparse.Namespace) -> int:
    root, name = _split_step(args.url)
    storage = open_storage(root)
    infos = [i for i in checkpoint.scan(storage) if name is None or i.name == name]
    if name is not None and not infos:
        print(f"{storage.describe(name)}: no such checkpoint", file=sys.stderr)
        return 1
    bad = 0
    for info in infos:
        try:
            checkpoint.verify(storage, info)
            print(f"{info.name}: ok")
        except CheckpointCorruptError as e:
            if info.status == "incomplete" and name is None:
                print(f"{info.name}: incomplete (ignored by resume)")
                continue
            bad += 1
            print(f"{info.name}: CORRUPT: {e}")
    return 1 if bad else 0


def _progress_bar(total: int, desc: str):  # type: ignore[no-untyped-def]
    """A tqdm bar on a terminal; a no-op object otherwise (quiet in logs and pipes)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not sys.stderr.isatty(), leave=False)


def _pick(storage, step: int | None) -> checkpoint.CheckpointInfo | None:  # type: ignore[no-untyped-def]
    infos = checkpoint.scan(storage)
    if step is None:
        complete = [i for i in infos if i.complete]
        return complete[-1] if complete else None
    return next((i for i in infos if i.step == step), None)


def _cmd_pull(args: argparse.Namespace) -> int:
    """Copy one checkpoint (verified) into DEST/step-N/, a local checkpoint root spotguard can resume from."""
    storage = open_storage(args.url)
    info = _pick(storage, args.step)
    if info is None:
        what = "no complete checkpoint" if args.step is None else f"no checkpoint of step {args.step}"
        print(f"spotguard: {what} in {storage.describe()}", file=sys.stderr)
        return 1
    if not info.complete or info.manifest is None:
        print(f"spotguard: {storage.describe(info.name)} is {info.status}: {info.problem}", file=sys.stderr)
        return 1
    dest = open_storage(args.dest)
    if dest.list(info.name + "/"):
        print(f"spotguard: {dest.describe(info.name)} already exists", file=sys.stderr)
        return 1
    bar = _progress_bar(info.manifest.size, info.name)
    if hasattr(storage, "progress"):
        storage.progress = bar.update
    try:
        for entry in info.manifest.files:
            with checkpoint.open_verified(storage, info, entry.name) as path, open(path, "rb") as src, \
                    dest.open_write(f"{info.name}/{entry.name}") as out:
                shutil.copyfileobj(src, out, 8 << 20)
                if not hasattr(storage, "progress"):
                    bar.update(entry.size)
        dest.put_bytes(f"{info.name}/{checkpoint.MANIFEST}", info.manifest.to_bytes(), exclusive=True)
    finally:
        bar.close()
    print(f"{dest.describe(info.name)}: pulled step {info.step} ({info.manifest.size / 1e6:.1f} MB, verified)")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    if args.step is not None:
        info = _pick(storage, args.step)
        if info is None:
            print(f"spotguard: no checkpoint of step {args.step} in {storage.describe()}", file=sys.stderr)
            return 1
        checkpoint.delete(storage, info.name)
        print(f"deleted {storage.describe(info.name)} ({info.status})")
        return 0
    doomed = [i for i in checkpoint.scan(storage) if i.status == "incomplete"]
    for info in doomed:
        checkpoint.delete(storage, info.name)
        print(f"deleted {storage.describe(info.name)} (incomplete: {info.problem})")
    cleanup = getattr(storage, "remove_temp_files", None) or getattr(storage, "abort_incomplete_uploads", None)
    leftovers = cleanup() if cleanup else []
    for name in leftovers:
        print(f"deleted leftover {name}")
    if not doomed and not leftovers:
        print(f"nothing incomplete in {storage.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotguard", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the checkpoints under a storage URL")
    p.add_argument("url", help="a path, file://, s3:// or gs:// URL")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("verify", help="check checkpoints against their manifests (exit 1 when corrupt)")
    p.add_argument("url", help="storage URL, or URL/step-NNNNNNNN for one checkpoint")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("pull", help="copy a checkpoint (verified) to a local directory")
    p.add_argument("url", help="storage URL (path, s3://, gs://)")
    p.add_argument("dest", help="local checkpoint root; the checkpoint lands in DEST/step-NNNNNNNN/")
    p.add_argument("--step", type=int, help="which step (default: the newest complete checkpoint)")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("rm", help="delete one checkpoint, or the leftovers of interrupted saves")
    p.add_argument("url", help="storage URL (path, s3://, gs://)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="delete the checkpoint of this step (manifest first)")
    what.add_argument("--incomplete", action="store_true",
                      help="delete checkpoints without a manifest and unfinished uploads")
    p.set_defaults(func=_cmd_rm)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except SpotguardError as e:
        print(f"spotguard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
