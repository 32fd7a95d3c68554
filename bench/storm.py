"""How late is a notice that appears during a storm of metadata errors, and how hard do we poll?

The mock metadata server (real HTTP on 127.0.0.1) runs calm for a second, then answers every
request with the next of 503, 500, 429, 401, random bytes, a reset, 502, an answer cut short; after
``--storm`` seconds, right after a 503 (a failed poll: the watcher is about to back off), the storm
ends and the notice appears. We time until ``Watcher.preempted`` and count requests per second
during the storm. Ours: the watcher's defaults (backoff capped near the 1 s interval; GCP retries
fast for 3 s). Baseline: the same watcher with backoff up to 5 s (the previous default).

    python bench/storm.py [--trials 5] [--storm 4]
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _rows import emit, parser, row  # noqa: E402

from spotguard import Watcher  # noqa: E402
from spotguard.notices.aws import AwsProvider  # noqa: E402
from spotguard.notices.azure import AzureProvider  # noqa: E402
from spotguard.notices.gcp import GcpProvider  # noqa: E402
from spotguard.ops.mockmeta import MockMetadataServer, make_mock  # noqa: E402

CASES = {"aws": (AwsProvider, "spot"), "gcp": (GcpProvider, "preempt"), "azure": (AzureProvider, "preempt")}


def trial(cloud: str, storm_s: float, **watcher_options: float) -> tuple[float, float]:
    """(seconds from the notice to ``preempted``, requests per second during the storm)."""
    cls, kind = CASES[cloud]
    flip: dict[str, float] = {}
    lock = threading.Lock()
    with MockMetadataServer(make_mock(cloud)) as server:

        def on_storm(answer: str) -> None:
            with lock:
                if answer != "503" or "at" in flip or time.monotonic() < flip["armed"]:
                    return
                server.set_storm(False)
                flip["at"], flip["requests"] = time.monotonic(), server.mock.requests
                server.mock.trigger(kind)

        seen: list[float] = []
        # GCP: hanging GETs of 1 s, so that one held since the calm ends within the storm's first second
        provider = cls(server.url, hang=1) if cloud == "gcp" else cls(server.url)
        with Watcher([provider], on_notice=lambda n: seen.append(time.monotonic()), **watcher_options) as watcher:
            time.sleep(1.0)  # calm: first reads done
            start, before = time.monotonic(), server.mock.requests
            flip["armed"] = start + storm_s
            server.on_storm = on_storm
            server.set_storm(True)
            if not watcher.preempted.wait(storm_s + 30):
                raise RuntimeError(f"{cloud}: notice not seen")
        return seen[0] - flip["at"], (flip["requests"] - before) / (flip["at"] - start)


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--storm", type=float, default=4.0, help="seconds of storm before the notice")
    args = ap.parse_args()
    logging.getLogger("spotguard").setLevel(logging.CRITICAL)  # a storm logs a lot by design
    rows = []
    for cloud in CASES:
        got = {
            name: [trial(cloud, args.storm, **opts) for _ in range(args.trials)]
            for name, opts in (("ours", {}), ("baseline", {"max_backoff": 5.0}))
        }
        lat = {k: [v[0] for v in vals] for k, vals in got.items()}
        rate = {k: statistics.mean(v[1] for v in vals) for k, vals in got.items()}
        label = "backoff up to 5 s"
        rows.append(
            row(
                f"notice mid-storm->preempted p50, {cloud}",
                statistics.median(lat["ours"]),
                "s",
                baseline=statistics.median(lat["baseline"]),
                baseline_label=label,
            )
        )
        rows.append(
            row(
                f"notice mid-storm->preempted max, {cloud} ({args.trials} trials)",
                max(lat["ours"]),
                "s",
                baseline=max(lat["baseline"]),
                baseline_label=label,
                target="<= 2 s",
                passed=lambda v, _r: v <= 2.0,
            )
        )
        rows.append(
            row(
                f"metadata requests/s during a storm, {cloud}",
                rate["ours"],
                "req/s",
                baseline=rate["baseline"],
                baseline_label=label,
                target="<= 10 req/s",
                passed=lambda v, _r: v <= 10.0,
            )
        )
        print(f"  {cloud}: done", file=sys.stderr, flush=True)
    emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
