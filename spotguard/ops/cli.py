"""The ``spotguard`` command: thin argument parsing over the library.

Each subcommand is one ``_cmd_*`` function registered in ``build_parser()``; it returns the exit
code. Logging is configured here (a library never configures handlers).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Sequence

from spotguard import __version__, checkpoint, planner
from spotguard.errors import CheckpointCorruptError, ConfigError, SpotguardError
from spotguard.notices.base import Notice
from spotguard.storage import open_storage

logger = logging.getLogger("spotguard.ops.cli")


def _cmd_ls(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    infos = checkpoint.scan(storage)
    # The listing checks manifests and sizes only; contents are read and hashed with --verify.
    verified = {i.name: _verify_one(storage, i) for i in infos if i.complete} if args.verify else {}
    if args.json:
        for info in infos:
            m = info.manifest
            bad = verified.get(info.name, "")
            print(json.dumps({"step": info.step, "name": info.name, "status": "corrupt" if bad else info.status,
                              "problem": bad or info.problem or None,
                              "verified": (not bad) if info.name in verified else None,
                              "time": m.time if m else None, "reason": m.reason if m else None,
                              "size": m.size if m else None}))
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
        print("(unverified: manifest and sizes checked; --verify reads every file and checks its SHA-256)")
    return 0


def _fail(args: argparse.Namespace, message: str, code: int = 1, **fields: object) -> int:
    """An error result: the message on stderr and, with --json, as a document on stdout."""
    print(f"spotguard: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "exit_code": code, **fields}))
    return code


def _verified(args: argparse.Namespace, text: str, url: str, info: checkpoint.CheckpointInfo | None,
              status: str, problem: str | None = None) -> None:
    """One verify result: a line of text, or with --json a document."""
    if args.json:
        print(json.dumps({"url": url, "name": info.name if info else None, "step": info.step if info else None,
                          "status": status, "problem": problem}))
    else:
        print(text)


def _verify_one(storage, info: checkpoint.CheckpointInfo) -> str:  # type: ignore[no-untyped-def]
    """The problem found by reading and hashing every file, or "" when it verifies."""
    try:
        checkpoint.verify(storage, info)
    except CheckpointCorruptError as e:
        return str(e)
    return ""


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
        if args.json:
            return _fail(args, f"{storage.describe(name)}: no such checkpoint", url=storage.describe(name))
        print(f"spotguard: {storage.describe(name)}: no such checkpoint", file=sys.stderr)
        return 1
    if not infos:  # a wrong path or an empty one must not look like a clean bill of health
        root_dir = getattr(storage, "root", None)
        missing = " (it does not exist)" if root_dir is not None and not root_dir.exists() else ""
        return _fail(args, f"no checkpoints in {storage.describe()}{missing}: nothing to verify", url=storage.describe())
    bad = 0
    for info in infos:
        where = storage.describe(info.name)
        try:
            checkpoint.verify(storage, info)
            _verified(args, f"{info.name}: ok", where, info, "ok")
        except CheckpointCorruptError as e:
            if info.status == "incomplete" and name is None:
                _verified(args, f"{info.name}: incomplete (ignored by resume)", where, info, "incomplete", str(e))
                continue
            bad += 1
            _verified(args, f"{info.name}: CORRUPT: {e}", where, info, "corrupt", str(e))
    return 1 if bad else 0


def _minutes(seconds: float | None) -> str:
    if seconds is None or math.isinf(seconds):
        return "-" if seconds is None else "unbounded"
    return f"{seconds / 60:.1f} min" if seconds < 36000 else f"{seconds / 3600:.1f} h"


def _cmd_plan(args: argparse.Namespace) -> int:
    from spotguard.guard.stats import MeasuredCosts, load_stats

    measured = load_stats(args.stats) if args.stats else MeasuredCosts(None, None, None)
    cost = args.checkpoint_cost if args.checkpoint_cost is not None else measured.checkpoint_s
    restart = args.restart_cost if args.restart_cost is not None else measured.restart_s
    if cost is None or restart is None:
        raise ConfigError("give --checkpoint-cost and --restart-cost (or a --stats file with them)")
    notice = args.notice if args.notice is not None else planner.NOTICE_LEAD_S.get(args.cloud or "")
    try:
        intervals = [float(v) for v in args.intervals.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--intervals takes seconds separated by commas, got {args.intervals!r}") from e
    opts = planner.PlanOptions(cost, restart, args.mtbf, notice_s=notice, notice_share=args.notice_share,
                               job_hours=args.job_hours, intervals_s=intervals,
                               state_gb=args.state_gb if args.state_gb is not None else measured.state_gb)
    plan = planner.plan(opts)
    if args.plot:
        from spotguard.ops.plot import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps({**plan.to_dict(), "plot": args.plot}, allow_nan=False))
        return 0
    head = f"checkpoint {opts.checkpoint_s:g} s, restart {opts.restart_s:g} s, MTBF {opts.mtbf_hours:g} h"
    if opts.notice_s is not None:
        head += f"; a notice {opts.notice_s:g} s ahead for {100 * (opts.notice_share or 0):.0f}% of preemptions"
        if not opts.notice_works:
            head += " (too short to write a checkpoint: ignored)"
    print(head)
    if not opts.notice_works:
        scope = "every preemption"
    elif math.isinf(plan.effective_mtbf_s):
        scope = "no preemption: every one comes with a notice, so the interval is the job length"
    else:
        scope = f"the preemptions without notice (effective MTBF {plan.effective_mtbf_s / 3600:.1f} h)"
    print(f"Young sqrt(2*C*MTBF) = {_minutes(plan.young_s)}, Daly = {_minutes(plan.daly_s)} "
          f"(best under the model: {_minutes(plan.optimum_s)}), covering {scope}")
    gb = opts.state_gb is not None
    print(f"\n{'STRATEGY':<26}{'INTERVAL':>10}{'GOODPUT':>9}{'LOST/PREEMPTION':>17}{'CKPT/H':>8}"
          + (f"{'GB/H':>8}" if gb else ""))
    for r in plan.rows:
        print(f"{r.name:<26}{_minutes(r.interval_s):>10}{100 * r.goodput:>8.1f}%{_minutes(r.lost_work_s):>17}"
              f"{r.checkpoints_per_hour:>8.2f}" + (f"{r.write_gb_per_hour:>8.1f}" if gb else ""))
    how = " plus an emergency checkpoint on notice" if opts.notice_works else ""
    print(f"\nrecommendation: checkpoint every {_minutes(plan.interval_s)} ({plan.interval_s:.0f} s){how}: "
          f"goodput {100 * plan.goodput:.1f}%, ~{_minutes(plan.lost_work_s)} of work lost per preemption "
          f"(job of {opts.job_hours:g} h for the no-checkpoint row)")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
def _cmd_run(args: argparse.Namespace) -> int:
    from spotguard.ops.supervisor import Supervisor, SupervisorOptions

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    options = SupervisorOptions(command, storage=args.storage, local_dir=args.local_dir, prefetch=args.prefetch,
                                max_restarts=args.max_restarts,
                                hang_timeout=args.hang_timeout, startup_timeout=args.startup_timeout,
                                backoff=args.backoff, backoff_max=args.backoff_max, grace=args.grace,
                                forward_as=args.forward_as, stdout_to_stderr=args.json)
    logging.getLogger("spotguard.ops.supervisor").setLevel(logging.INFO if args.verbose < 2 else logging.DEBUG)
    supervisor = Supervisor(options)
    exporter = None
    if args.metrics_port is not None or args.metrics_file:
        from spotguard.metrics.run import RunMetrics

        logging.getLogger("spotguard.metrics").setLevel(logging.INFO)
        exporter = RunMetrics(supervisor, port=args.metrics_port, host=args.metrics_host, jsonl=args.metrics_file)
    try:
        return supervisor.run()
    except SpotguardError as e:
        if not args.json:
            raise
        print(f"spotguard: error: {e}", file=sys.stderr)
        return 2
    finally:
        if exporter is not None:
            exporter.close()
        if args.json:
            print(json.dumps(supervisor.summary()), flush=True)
def _cmd_mock_metadata(args: argparse.Namespace) -> int:
    from spotguard.ops import mockmeta

    options = {"require_tokens": not args.imdsv1} if args.cloud == "aws" else {}
    server = mockmeta.MockMetadataServer(mockmeta.make_mock(args.cloud, **options), args.host, args.port,
                                         error_rate=args.error_rate, seed=args.seed)
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


def _cmd_simulate(args: argparse.Namespace) -> int:
    from spotguard.ops import mockmeta

    if args.pid is not None:
        sig = signal.Signals[args.signal if args.signal.startswith("SIG") else "SIG" + args.signal]
        try:
            os.kill(args.pid, sig)
        except ProcessLookupError:
            print(f"spotguard: error: no process {args.pid}", file=sys.stderr)
            return 1
        except PermissionError:
            print(f"spotguard: error: not allowed to signal process {args.pid} (another user's; try sudo)",
                  file=sys.stderr)
            return 1
        print(f"sent {sig.name} to process {args.pid}")
        return 0
    if args.file:
        payload = {"kind": args.kind or "terminate", "deadline_in": args.deadline_in}
        tmp = f"{args.file}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, args.file)  # atomic: the watcher never reads half a notice
        print(f"wrote notice file {args.file}: {json.dumps(payload)}")
        return 0
    endpoint = args.endpoint or _default_endpoint(args.cloud)
    state = mockmeta.control(endpoint, "state")
    if args.cloud and state.get("cloud") != args.cloud:
        print(f"spotguard: error: the mock at {endpoint} imitates {state.get('cloud')}, not {args.cloud}",
              file=sys.stderr)
        return 1
    if args.clear:
        mockmeta.control(endpoint, "clear")
        print(f"cleared every notice on the {state.get('cloud')} mock at {endpoint}")
        return 0
    payload = {"kind": args.kind, "in": args.in_, **({"action": args.action} if args.action else {})}
    answer = mockmeta.control(endpoint, "trigger", payload)
    when = f"in {args.in_:g}s" if args.in_ else "now"
    shown = {k: v for k, v in answer.items() if k in _SHOWN}
    print(f"{answer.get('cloud')} {answer.get('kind')} notice {when} on {endpoint}"
          + (f": {json.dumps(shown)}" if shown else ""))
    return 0


_SHOWN = ("action", "time", "noticeTime", "Code", "NotBefore", "EventId", "EventType", "instance/preempted",
          "instance/maintenance-event", "target-lifecycle-state")


def _default_endpoint(cloud: str | None) -> str:
    from spotguard.ops import mockmeta

    for name in ([cloud] if cloud else []):
        for key, _ in mockmeta.endpoint_env(name, "").items():
            if os.environ.get(key):
                value = os.environ[key]
                return value if "://" in value else "http://" + value
    return f"http://127.0.0.1:{mockmeta.DEFAULT_PORT}"


def _cmd_watch(args: argparse.Namespace) -> int:
    from spotguard.watcher import Watcher

    def show(notice: Notice) -> None:
        if args.json:
            print(json.dumps(notice.to_json()), flush=True)
            return
        left = notice.seconds_left()
        print(f"{notice.provider}: {notice.kind} notice"
              + (f", deadline {notice.deadline.isoformat()} ({left:.0f}s left)" if notice.deadline and left is not None else "")
              + (" (advisory)" if notice.advisory else ""), flush=True)

    watcher = Watcher(args.providers, args.interval, on_notice=show, stop_on_advisory=args.advisory)
    if not args.json:
        print(f"watching {', '.join(p.name for p in watcher.providers) or 'nothing'} "
              f"every {args.interval:g}s", file=sys.stderr, flush=True)
    try:
        with watcher:
            got = watcher.preempted.wait(args.timeout)
    except KeyboardInterrupt:
        return 130
    return 0 if got else 1
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
        return _fail(args, f"{what} in {storage.describe()}", url=storage.describe())
    if not info.complete or info.manifest is None:
        return _fail(args, f"{storage.describe(info.name)} is {info.status}: {info.problem}",
                     url=storage.describe(info.name))
    dest = open_storage(args.dest)
    if dest.list(info.name + "/"):
        return _fail(args, f"{dest.describe(info.name)} already exists", url=dest.describe(info.name))
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
    if args.json:
        print(json.dumps({"url": dest.describe(info.name), "source": storage.describe(info.name), "step": info.step,
                          "name": info.name, "size": info.manifest.size, "verified": True}))
    else:
        print(f"{dest.describe(info.name)}: pulled step {info.step} ({info.manifest.size / 1e6:.1f} MB, verified)")
    return 0


def _deleted(args: argparse.Namespace, text: str, url: str, step: int | None, status: str,
             problem: str | None) -> None:
    if args.json:
        print(json.dumps({"deleted": url, "step": step, "status": status, "problem": problem or None}))
    else:
        print(text)


def _cmd_rm(args: argparse.Namespace) -> int:
    storage = open_storage(args.url)
    if args.step is not None:
        info = _pick(storage, args.step)
        if info is None:
            return _fail(args, f"no checkpoint of step {args.step} in {storage.describe()}", url=storage.describe())
        checkpoint.delete(storage, info.name)
        _deleted(args, f"deleted {storage.describe(info.name)} ({info.status})", storage.describe(info.name),
                 info.step, info.status, info.problem)
        return 0
    doomed = [i for i in checkpoint.scan(storage) if i.status == "incomplete"]
    for info in doomed:
        checkpoint.delete(storage, info.name)
        _deleted(args, f"deleted {storage.describe(info.name)} (incomplete: {info.problem})",
                 storage.describe(info.name), info.step, info.status, info.problem)
    cleanup = getattr(storage, "remove_temp_files", None) or getattr(storage, "abort_incomplete_uploads", None)
    leftovers = cleanup() if cleanup else []
    for name in leftovers:
        _deleted(args, f"deleted leftover {name}", name, None, "leftover", None)
    if args.json:
        return 0  # one document per deletion; none when there was nothing to delete
    if not doomed and not leftovers:
        print(f"nothing incomplete in {storage.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotguard", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"spotguard {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the checkpoints under a storage URL")
    p.add_argument("url", help="a path, file://, s3://, gs:// or az:// URL")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--verify", action="store_true", help="read every file and check its SHA-256 "
                   "(default: manifests and sizes only; contents unverified)")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("verify", help="check checkpoints against their manifests (exit 1 when corrupt, "
                       "or when there is nothing to verify)")
    p.add_argument("url", help="storage URL, or URL/step-NNNNNNNN for one checkpoint")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint (status ok, corrupt or "
                   "incomplete); an error object and exit 1 when there is nothing to verify")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("plan", help="how often to checkpoint: interval, goodput and lost work per strategy")
    p.add_argument("--checkpoint-cost", type=float, metavar="S", help="seconds the loop is blocked per checkpoint")
    p.add_argument("--restart-cost", type=float, metavar="S", help="seconds from a preemption to training again")
    p.add_argument("--mtbf", type=float, required=True, metavar="H", help="mean hours between preemptions")
    p.add_argument("--notice", type=float, metavar="S",
                   help="seconds of notice before a preemption (default: no notice, plain Young/Daly)")
    p.add_argument("--notice-share", type=float, metavar="F",
                   help=f"share of preemptions that come with the notice (default {planner.DEFAULT_NOTICE_SHARE} "
                        f"with --notice; alone it assumes a {planner.DEFAULT_NOTICE_S:g} s notice)")
    p.add_argument("--cloud", choices=sorted(planner.NOTICE_LEAD_S), help="the notice lead of this cloud")
    p.add_argument("--job-hours", type=float, default=24.0, metavar="H", help="job length (default 24)")
    p.add_argument("--state-gb", type=float, metavar="G", help="checkpoint size, to report GB written per hour")
    p.add_argument("--intervals", default=",".join(f"{v:g}" for v in planner.DEFAULT_INTERVALS_S),
                   metavar="S,S,...", help="fixed intervals to compare, in seconds")
    p.add_argument("--stats", metavar="FILE", help="measured costs: records of json.dumps(guard.stats().as_dict()), "
                   "a JSON object, list or lines; restart cost = restore_s + 60 s of start unless restart_s is given")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw goodput vs interval (needs spotguard[plot])")
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("run", help="run a training command; restart it after a crash or hang, not after a preemption",
                       description="Exit codes: 0 finished, 75 stopped for a notice (do not restart), "
                                   "2 restart budget used up or bad options, 128+N stopped by signal N "
                                   "(the job died of it or did not exit in time); after a stop signal, "
                                   "otherwise the job's own exit code.")
    p.add_argument("--storage", help="checkpoint URL, passed to the job as $SPOTGUARD_STORAGE")
    p.add_argument("--local-dir", help="the job's fast local tier (e.g. NVMe), passed as $SPOTGUARD_LOCAL_DIR")
    p.add_argument("--prefetch", action="store_true", help="copy the newest checkpoint into --local-dir, verified, "
                   "before starting the job")
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
    p.add_argument("--json", action="store_true", help="print one JSON document at the end (exit code, outcome, "
                   "restarts by cause, every exit); the job's stdout goes to stderr")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics (restarts and "
                   "their causes) on this port (needs spotguard[metrics])")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address to serve them on (default 127.0.0.1)")
    p.add_argument("--metrics-file", metavar="FILE", help="append one JSON line per start, exit and the end")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- python train.py ...")
    p.set_defaults(func=_cmd_run)
    clouds = ("aws", "gcp", "azure")
    p = sub.add_parser("mock-metadata", help="serve a faithful mock of a cloud's metadata service on 127.0.0.1")
    p.add_argument("--cloud", choices=clouds, default="aws")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1338, help="0 picks a free port (default 1338)")
    p.add_argument("--notice-after", type=float, metavar="SECONDS", help="trigger the spot notice after this long")
    p.add_argument("--kind", help="notice kind for --notice-after (default: the cloud's spot notice)")
    p.add_argument("--action", help="AWS spot action: terminate (default), stop or hibernate")
    p.add_argument("--error-rate", type=float, default=0.0, help="answer this fraction of requests with 503")
    p.add_argument("--seed", type=int, help="seed of the mock's private generator for --error-rate")
    p.add_argument("--imdsv1", action="store_true", help="AWS: accept requests without a token")
    p.set_defaults(func=_cmd_mock_metadata)

    p = sub.add_parser("simulate-preemption", help="rehearse a preemption: mock notice, signal or notice file")
    p.add_argument("--cloud", choices=clouds, help="check the mock imitates this cloud; picks its endpoint variable")
    p.add_argument("--endpoint", help="mock server base URL http://host:port (default: the cloud's variable, "
                                      "else http://127.0.0.1:1338)")
    p.add_argument("--in", dest="in_", type=float, default=0.0, metavar="SECONDS", help="notice appears later")
    p.add_argument("--kind", help="aws: spot|rebalance|maintenance|asg; gcp: preempt|maintenance|migrate; "
                                  "azure: preempt|terminate|reboot|redeploy|freeze")
    p.add_argument("--action", help="AWS spot action: terminate, stop or hibernate")
    p.add_argument("--clear", action="store_true", help="withdraw every notice (the server serves the next run)")
    p.add_argument("--pid", type=int, help="send a shutdown signal to this process instead")
    p.add_argument("--signal", default="SIGTERM", help="signal for --pid (default SIGTERM)")
    p.add_argument("--file", help="write this notice file instead (see $SPOTGUARD_NOTICE_FILE)")
    p.add_argument("--deadline-in", type=float, default=120.0, help="deadline written to --file (seconds)")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("watch", help="run the notice watcher alone; exit 0 on a notice",
                       description="Prints notices as they arrive and exits 0 on the first stop notice "
                                   "(or advisory one with --advisory); exit 1 at --timeout.")
    p.add_argument("--providers", default="auto", help="'auto' or a comma list: signal,file,aws,gcp,azure")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="one JSON object per notice")
    p.add_argument("--timeout", type=float, help="give up after this many seconds (exit 1)")
    p.add_argument("--advisory", action="store_true", help="advisory notices (AWS rebalance recommendation, "
                   "GCP migrate) end it too, exit 0 (default: they are printed, only stop notices end it)")
    p.set_defaults(func=_cmd_watch)
    p = sub.add_parser("pull", help="copy a checkpoint (verified) to a local directory")
    p.add_argument("url", help="storage URL (path, s3://, gs://, az://)")
    p.add_argument("dest", help="local checkpoint root; the checkpoint lands in DEST/step-NNNNNNNN/")
    p.add_argument("--step", type=int, help="which step (default: the newest complete checkpoint)")
    p.add_argument("--json", action="store_true", help="one JSON object: the pulled checkpoint, or an error")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("rm", help="delete one checkpoint, or the leftovers of interrupted saves")
    p.add_argument("url", help="storage URL (path, s3://, gs://, az://)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="delete the checkpoint of this step (manifest first)")
    what.add_argument("--incomplete", action="store_true",
                      help="delete checkpoints without a manifest and unfinished uploads")
    p.add_argument("--json", action="store_true", help="one JSON object per thing deleted, or an error")
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
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "exit_code": 2, "type": type(e).__name__}))
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
