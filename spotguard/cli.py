"""The ``spotguard`` command: thin argument parsing over the library.

Each subcommand is one ``_cmd_*`` function registered in ``build_parser()``; it returns the exit
code. Logging is configured here (a library never configures handlers).
"""

from __future__ import annotations

import argparse
import json
import logging
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


def _cmd_run(args: argparse.Namespace) -> int:
    from .supervisor import Supervisor, SupervisorOptions

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    options = SupervisorOptions(command, storage=args.storage, max_restarts=args.max_restarts,
                                hang_timeout=args.hang_timeout, startup_timeout=args.startup_timeout,
                                backoff=args.backoff, backoff_max=args.backoff_max, grace=args.grace,
                                forward_as=args.forward_as)
    logging.getLogger("spotguard.supervisor").setLevel(logging.INFO if args.verbose < 2 else logging.DEBUG)
    return Supervisor(options).run()


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

    p = sub.add_parser("run", help="run a training command; restart it after a crash or hang, not after a preemption",
                       description="Exit codes: 0 finished, 75 stopped for a notice (do not restart), "
                                   "2 restart budget used up or bad options, 128+N stopped by signal N "
                                   "without the job exiting in time.")
    p.add_argument("--storage", help="checkpoint URL, passed to the job as $SPOTGUARD_STORAGE")
    p.add_argument("--max-restarts", type=int, default=10, help="restarts after crashes/hangs (default 10)")
    p.add_argument("--hang-timeout", type=float, help="seconds without a completed step before the job "
                   "counts as hung (default: no watchdog)")
    p.add_argument("--startup-timeout", type=float, help="the same before the first step (default: --hang-timeout)")
    p.add_argument("--backoff", type=float, default=1.0, help="first restart delay in seconds, doubled each restart")
    p.add_argument("--backoff-max", type=float, default=60.0, help="longest restart delay (default 60)")
    p.add_argument("--grace", type=float, default=120.0, help="seconds the job gets to checkpoint and exit "
                   "after a forwarded stop signal (default 120)")
    p.add_argument("--forward-as", metavar="SIGNAL", help="forward stop signals as this one (e.g. USR1) "
                   "where the platform also signals the job directly (Slurm preemption)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- python train.py ...")
    p.set_defaults(func=_cmd_run)
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
