"""Notice-to-commit time of the emergency checkpoint, for several state sizes, beside the budget.

The clock starts when the notice reaches the watcher (detection latency is bench/detection.py's
job) and stops when ``guard.step()`` returns True, i.e. when the manifest is committed in durable
storage. Baseline measured in the same run: a plain ``torch.save`` + fsync of the same state.
Budget: 30 s (GCP and Azure; AWS gives 120 s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import spotguard
from spotguard import Notice


def state_of(size_mb: int) -> torch.nn.Module:
    n = 2048
    return torch.nn.Sequential(*[torch.nn.Linear(n, n, bias=False)
                                 for _ in range(max(1, round(size_mb * 2**20 / (n * n * 4))))])


def one(url: str, model: torch.nn.Module, budget: float) -> float:
    guard = spotguard.Guard(url, providers=[], save_on_exit=False).track(model=model)
    with guard:
        guard.step(1)
        notice = Notice("bench", "preempt", deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=budget))
        t0 = time.perf_counter()
        guard.watcher.report(notice)
        assert guard.step(2) is True and guard.emergency_error is None, guard.emergency_error
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="512,1024,2048")
    ap.add_argument("--url", default=None, help="durable storage URL (default: a temp dir); s3://... works too")
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--json", help="append result rows (JSON lines) to this file")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sg-emerg-"))
    rows = []
    try:
        for size in (int(s) for s in args.sizes_mb.split(",")):
            model = state_of(size)
            sd = model.state_dict()
            t0 = time.perf_counter()
            with open(tmp / "plain.pt", "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            baseline = time.perf_counter() - t0
            url = f"{args.url.rstrip('/')}/emerg-{size}-{time.time_ns()}" if args.url else str(tmp / f"sg-{size}")
            ours = one(url, model, args.budget)
            rows.append((size, ours, baseline))
            del model, sd
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    where = args.url or "local disk"
    print(f"emergency checkpoint, notice -> committed ({where}); budget {args.budget:.0f}s")
    print(f"{'state':>8} {'spotguard':>10} {'torch.save+fsync':>17} {'ratio':>6} {'budget used':>12}")
    for size, ours, base in rows:
        print(f"{size:>6}MB {ours:9.2f}s {base:16.2f}s {ours / base:6.2f} {ours / args.budget:11.0%}")
    if args.json:
        out = []
        for size, ours, base in rows:
            out.append({"figure": f"emergency notice->commit {size} MB ({where})", "value": round(ours, 2),
                                "unit": "s", "baseline": round(base, 2), "ratio": round(ours / base, 2),
                                "target": f"< {args.budget:.0f} s", "pass": ours < args.budget})
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
