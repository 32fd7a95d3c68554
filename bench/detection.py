"""How fast does a cloud notice become ``preempted``, and what does watching cost when nothing happens?

Latency: the mock metadata server (real HTTP on 127.0.0.1) makes the notice visible at a random
moment relative to the watcher's polling phase; we time until ``Watcher.preempted`` is set. The
baseline is the polling interval itself (what a plain poller's worst case is); AWS and Azure poll
at the default 1 s, GCP uses the hanging GET.

Idle cost: ``spotguard watch --providers <cloud>`` runs in a child process against the mock for a
while; its CPU seconds (user + system, from /proc) are scaled to one hour. The baseline is a
naive poller written the usual way (``requests``, a new IMDSv2 token and connection every second).

    python bench/detection.py [--trials 100] [--idle-seconds 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from spotguard import Watcher  # noqa: E402
from spotguard.notices.aws import AwsProvider  # noqa: E402
from spotguard.notices.azure import AzureProvider  # noqa: E402
from spotguard.notices.gcp import GcpProvider  # noqa: E402
from spotguard.ops.mockmeta import MockMetadataServer, endpoint_env, make_mock  # noqa: E402

_rng = random.Random(1)  # the benchmark's own generator (phases), never the global one

NAIVE_POLLER = """
import sys, time, requests
url = sys.argv[1]
while True:
    token = requests.put(url + "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}).text
    requests.get(url + "/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token})
    time.sleep(1.0)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def latency(cloud: str, trials: int, interval: float) -> list[float]:
    mock = make_mock(cloud)
    providers = {"aws": AwsProvider, "gcp": GcpProvider, "azure": AzureProvider}
    out: list[float] = []
    with MockMetadataServer(mock) as server:
        provider = providers[cloud](server.url)
        for _ in range(trials):
            mock.clear()
            seen = threading.Event()
            stamp: list[float] = []

            def record(_notice: object, stamp: list[float] = stamp, seen: threading.Event = seen) -> None:
                stamp.append(time.monotonic())
                seen.set()

            watcher = Watcher([provider], interval=interval, on_notice=record)
            with watcher:
                time.sleep(0.2 + _rng.uniform(0, interval))  # a random phase against the polling clock
                t0 = time.monotonic()
                mock.trigger()
                if not seen.wait(10):
                    raise RuntimeError(f"{cloud}: no notice within 10 s")
            out.append(stamp[0] - t0)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of a live process, nanosecond resolution: the sum over its threads' schedstat."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
    return total / 1e9


def idle_cpu(seconds: float, warmup: float = 3.0) -> dict[str, float]:
    """CPU seconds per hour for each watcher (and the naive poller), measured side by side."""
    servers = {c: MockMetadataServer(make_mock(c)).start() for c in ("aws", "gcp", "azure")}
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env_base["PYTHONPATH"] = str(REPO)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for cloud, server in servers.items():
            procs[cloud] = subprocess.Popen(
                [sys.executable, "-m", "spotguard", "watch", "--providers", cloud, "--interval", "1"],
                env=dict(env_base, **endpoint_env(cloud, server.url)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        procs["naive"] = subprocess.Popen(
            [sys.executable, "-c", NAIVE_POLLER, servers["aws"].url],
            env=env_base,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not all(server.mock.requests for server in servers.values()):  # every watcher has started
            if time.monotonic() > deadline:
                raise RuntimeError("the watchers did not start polling within 120 s")
            time.sleep(0.1)
        time.sleep(warmup)  # imports done, polling steady
        start = {name: cpu_seconds(p.pid) for name, p in procs.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        took = time.monotonic() - t0
        return {name: (cpu_seconds(p.pid) - start[name]) / took * 3600 for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(10)
        for server in servers.values():
            server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (for bench/run_all.py)")
    args = ap.parse_args()
    logging.getLogger("spotguard").setLevel(logging.ERROR)  # one warning per detected notice otherwise
    out: list[dict] = []

    rows = []
    for cloud, how in (("aws", "poll, IMDSv2"), ("azure", "poll, Scheduled Events"), ("gcp", "hanging GET")):
        values = latency(cloud, args.trials, args.interval)
        rows.append((cloud, how, statistics.median(values), percentile(values, 99), max(values)))
        print(f"  {cloud}: {len(values)} trials done", file=sys.stderr, flush=True)
    print(
        f"\nNotice -> preempted latency ({args.trials} trials per cloud, random phase; "
        f"baseline = the polling interval, {args.interval:.3f} s)"
    )
    print(
        f"{'cloud':<6} {'mechanism':<24} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'baseline s':>10} {'p99/baseline':>12}"
    )
    for cloud, how, p50, p99, worst in rows:
        print(
            f"{cloud:<6} {how:<24} {p50:7.3f} {p99:7.3f} {worst:7.3f} {args.interval:10.3f} {p99 / args.interval:12.2f}"
        )
        limit = 0.1 if cloud == "gcp" else args.interval + 0.1
        out.append(_row(f"notice->preempted p50, {cloud} ({how})", p50, "s", args.interval))
        out.append(
            _row(f"notice->preempted p99, {cloud} ({how})", p99, "s", args.interval, f"<= {limit:g} s", p99 <= limit)
        )

    cpu = idle_cpu(args.idle_seconds)
    print(
        f"\nIdle watcher CPU (seconds per hour of watching, measured over {args.idle_seconds:.0f} s; "
        f"baseline = a naive requests poller, new token + connection each second)"
    )
    print(f"{'watcher':<22} {'CPU s/hour':>10} {'baseline':>9} {'ratio':>6}")
    for cloud in ("aws", "azure", "gcp"):
        print(f"{'spotguard ' + cloud:<22} {cpu[cloud]:10.1f} {cpu['naive']:9.1f} {cpu[cloud] / cpu['naive']:6.2f}")
        out.append(
            _row(
                f"idle watcher CPU, {cloud} (1 s interval)",
                cpu[cloud],
                "CPU s/hour",
                cpu["naive"],
                baseline_label="naive requests poller",
            )
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _row(
    figure: str,
    value: float,
    unit: str,
    baseline: float,
    target: str | None = None,
    passed: bool | None = None,
    baseline_label: str = "polling interval",
) -> dict:
    """One row in bench/run_all.py's JSON convention."""
    return {
        "figure": figure,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": value / baseline if baseline else None,
        "target": target,
        "pass": passed,
    }


if __name__ == "__main__":
    sys.exit(main())
