"""``spotguard mock-metadata`` (serve a cloud's metadata service locally, ``spotguard.ops.mockmeta``)
and ``spotguard simulate-preemption`` (drive it, signal a process, or write a notice file)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

CLOUDS = ("aws", "gcp", "azure")
#: Fields of a mock's answer worth echoing after a trigger.
_SHOWN = (
    "action",
    "time",
    "noticeTime",
    "Code",
    "NotBefore",
    "EventId",
    "EventType",
    "instance/preempted",
    "instance/maintenance-event",
    "target-lifecycle-state",
)


def cmd_mock_metadata(args: argparse.Namespace) -> int:
    from spotguard.ops import mockmeta

    options = {"require_tokens": not args.imdsv1} if args.cloud == "aws" else {}
    server = mockmeta.MockMetadataServer(
        mockmeta.make_mock(args.cloud, **options), args.host, args.port, error_rate=args.error_rate, seed=args.seed
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        env = " ".join(f"{k}={v}" for k, v in mockmeta.endpoint_env(args.cloud, server.url).items())
        print(f"spotguard mock {args.cloud} metadata server on {server.url}", flush=True)
        print(f"  point a job at it: {env}", flush=True)
        if args.notice_after is not None:
            server.mock.trigger(args.kind, args.notice_after, action=args.action)
            print(f"  notice in {args.notice_after:g}s", flush=True)
        stop.wait()
    return 0


def _signal_process(pid: int, name: str) -> int:
    from spotguard.ops.supervisor.options import to_signal

    sig = to_signal(name)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        print(f"spotguard: error: no process {pid}", file=sys.stderr)
        return 1
    except PermissionError:
        print(f"spotguard: error: not allowed to signal process {pid} (another user's; try sudo)", file=sys.stderr)
        return 1
    print(f"sent {sig.name} to process {pid}")
    return 0


def _write_notice_file(path: str, kind: str | None, deadline_in: float) -> int:
    from spotguard.errors import ConfigError

    payload = {"kind": kind or "terminate", "deadline_in": deadline_in}
    if os.path.isdir(path):
        raise ConfigError(f"--file {path} is a folder: give the path of the notice file the job watches")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)  # atomic: the watcher never reads half a notice
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # never leave PATH.tmp behind
        raise ConfigError(f"cannot write the notice file {path}: {e.strerror or e}") from e
    print(f"wrote notice file {path}: {json.dumps(payload)}")
    return 0


def _clear_notice_file(path: str) -> int:
    """Withdraw the notice ``--file`` wrote; none there is already the state asked for."""
    from spotguard.errors import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"--file {path} is a folder: give the path of the notice file the job watches")
    try:
        os.unlink(path)
    except FileNotFoundError:
        print(f"no notice file {path}: nothing to clear")
        return 0
    except OSError as e:
        raise ConfigError(f"cannot remove the notice file {path}: {e.strerror or e}") from e
    print(f"removed notice file {path}")
    return 0


def _act_here(args: argparse.Namespace) -> int:
    """``--pid`` or ``--file``: done by this process, so ``--in`` is waited out here (the mock waits
    on its own); ``--clear`` withdraws a notice file, but a signal once sent cannot be taken back."""
    from spotguard.errors import ConfigError

    if args.clear and args.pid is not None:
        raise ConfigError("--clear withdraws a mock's notice or a --file; a signal sent to --pid cannot be withdrawn")
    if args.clear:
        return _clear_notice_file(args.file)
    if not 0 <= args.in_ < math.inf:
        raise ConfigError(f"--in must be 0 or more seconds, got {args.in_:g}")
    try:
        time.sleep(args.in_)
    except KeyboardInterrupt:
        print("spotguard: interrupted: nothing " + ("sent" if args.pid is not None else "written"), file=sys.stderr)
        return 130
    if args.pid is not None:
        return _signal_process(args.pid, args.signal)
    return _write_notice_file(args.file, args.kind, args.deadline_in)


def cmd_simulate(args: argparse.Namespace) -> int:
    from spotguard.ops import mockmeta

    if args.pid is not None or args.file:
        return _act_here(args)
    endpoint = args.endpoint or _default_endpoint(args.cloud)
    state = mockmeta.control(endpoint, "state")
    if args.cloud and state.get("cloud") != args.cloud:
        print(
            f"spotguard: error: the mock at {endpoint} imitates {state.get('cloud')}, not {args.cloud}", file=sys.stderr
        )
        return 1
    if args.clear:
        mockmeta.control(endpoint, "clear")
        print(f"cleared every notice on the {state.get('cloud')} mock at {endpoint}")
        return 0
    payload = {"kind": args.kind, "in": args.in_, **({"action": args.action} if args.action else {})}
    answer = mockmeta.control(endpoint, "trigger", payload)
    when = f"in {args.in_:g}s" if args.in_ else "now"
    shown = {k: v for k, v in answer.items() if k in _SHOWN}
    print(
        f"{answer.get('cloud')} {answer.get('kind')} notice {when} on {endpoint}"
        + (f": {json.dumps(shown)}" if shown else "")
    )
    return 0


def _default_endpoint(cloud: str | None) -> str:
    """The cloud's endpoint variable where set (as the job would read it), else the mock's default port."""
    from spotguard.ops import mockmeta

    for key in mockmeta.endpoint_env(cloud, "") if cloud else ():
        value = os.environ.get(key)
        if value:
            return value if "://" in value else "http://" + value
    return f"http://127.0.0.1:{mockmeta.DEFAULT_PORT}"


def register(sub: Any) -> None:
    """Add ``mock-metadata`` and ``simulate-preemption`` to the ``spotguard`` subcommands."""
    p = sub.add_parser("mock-metadata", help="serve a faithful mock of a cloud's metadata service on 127.0.0.1")
    p.add_argument("--cloud", choices=CLOUDS, default="aws", help="the metadata service to imitate (default aws)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=1338, help="0 picks a free port (default 1338)")
    p.add_argument("--notice-after", type=float, metavar="SECONDS", help="trigger the spot notice after this long")
    p.add_argument("--kind", help="notice kind for --notice-after (default: the cloud's spot notice)")
    p.add_argument("--action", help="AWS spot action: terminate (default), stop or hibernate")
    p.add_argument("--error-rate", type=float, default=0.0, help="answer this fraction of requests with 503")
    p.add_argument("--seed", type=int, help="seed of the mock's private generator for --error-rate")
    p.add_argument("--imdsv1", action="store_true", help="AWS: accept requests without a token")
    p.set_defaults(func=cmd_mock_metadata)

    p = sub.add_parser("simulate-preemption", help="rehearse a preemption: mock notice, signal or notice file")
    p.add_argument("--cloud", choices=CLOUDS, help="check the mock imitates this cloud; picks its endpoint variable")
    p.add_argument(
        "--endpoint",
        help="mock server base URL http://host:port (default: the cloud's variable, else http://127.0.0.1:1338)",
    )
    p.add_argument(
        "--in",
        dest="in_",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="notice appears later (with --pid or --file: this command waits, then acts)",
    )
    p.add_argument(
        "--kind",
        help="aws: spot|rebalance|maintenance|asg; gcp: preempt|maintenance|migrate; "
        "azure: preempt|terminate|reboot|redeploy|freeze",
    )
    p.add_argument("--action", help="AWS spot action: terminate, stop or hibernate")
    p.add_argument(
        "--clear", action="store_true", help="withdraw every notice (the server serves the next run), or remove --file"
    )
    p.add_argument("--pid", type=int, help="send a shutdown signal to this process instead")
    p.add_argument("--signal", default="SIGTERM", help="signal for --pid (default SIGTERM)")
    p.add_argument("--file", help="write this notice file instead (see $SPOTGUARD_NOTICE_FILE)")
    p.add_argument(
        "--deadline-in", type=float, default=120.0, help="deadline written to --file, in seconds (default 120)"
    )
    p.set_defaults(func=cmd_simulate)
