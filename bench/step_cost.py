"""Cost of guard.step() when nothing is due (the training loop's hot path), beside baselines.

Baselines measured in the same run: a call to an empty Python method (the floor for any API of this
shape) and ``threading.Event.is_set()`` (the flag check alone). The "metrics on" row runs the
Prometheus endpoint and the JSON lines exporter (``spotguard[metrics]``) beside the loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import timeit
from pathlib import Path

import torch

import spotguard


class _Empty:
    def step(self, step: int) -> bool:
        return False


def per_call_ns(stmt, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=1_000_000)
    ap.add_argument("--json", help="append result rows (JSON lines) to this file")
    ap.add_argument("--no-metrics", action="store_true", help="skip the row with spotguard.metrics exporting")
    args = ap.parse_args()
    n = args.number
    with tempfile.TemporaryDirectory() as d:
        rows = []
        configs = [("every_steps", {"every_steps": 10**9}), ("every_seconds", {"every_seconds": 1e9})]
        if not args.no_metrics:  # the exporter's thread and endpoint run beside the loop, not in it
            configs.append(
                (
                    "every_steps, metrics on",
                    {"every_steps": 10**9, "metrics_port": 0, "metrics_file": f"{d}/metrics.jsonl"},
                )
            )
        for label, kw in configs:
            guard = spotguard.Guard(d, providers=[], **kw).track(model=torch.nn.Linear(1, 1))
            with guard:
                ours = per_call_ns(lambda g=guard: g.step(1), n)
            rows.append((f"guard.step() nothing due ({label})", ours))
    empty, event = _Empty(), threading.Event()
    base = per_call_ns(lambda: empty.step(1), n)
    flag = per_call_ns(lambda: event.is_set(), n)
    print(f"{'figure':<52} {'ns/call':>8} {'baseline':>9} {'ratio':>6}")
    for name, ns in rows:
        print(f"{name:<52} {ns:8.0f} {base:9.0f} {ns / base:6.2f}   (target < 1000 ns)")
    print(f"{'Event.is_set() alone':<52} {flag:8.0f}")
    print("(all figures include the ~same lambda-call overhead of timeit)")
    if args.json:
        out = []
        for name, ns in rows:
            out.append(
                {
                    "figure": name,
                    "value": round(ns),
                    "unit": "ns",
                    "baseline": round(base),
                    "baseline_label": "empty method call",
                    "ratio": round(ns / base, 2),
                    "target": "< 1000 ns",
                    "pass": ns < 1000,
                }
            )
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
