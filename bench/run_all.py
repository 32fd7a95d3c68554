"""``make bench``: run every ``bench/*.py`` and write one markdown table, bench/REPORT.md.

Convention for a benchmark script: it prints its own table for people, and when given
``--json PATH`` it also writes a JSON list of rows there, one per figure::

    {"figure": "...", "value": 0.93, "unit": "goodput", "baseline": 0.90, "baseline_label": "...",
     "ratio": 1.03, "target": "ratio >= 1", "pass": true}

``baseline``, ``ratio``, ``target`` and ``pass`` may be null (a figure without a baseline or target).
Every figure the README quotes comes from this report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def scripts(only: list[str]) -> list[Path]:
    found = sorted(p for p in HERE.glob("*.py") if p.name != "run_all.py" and not p.name.startswith("_"))
    return [p for p in found if not only or p.stem in only]


def run(script: Path, timeout: float) -> tuple[list[dict], str]:
    """Rows written by ``script`` (a failing script gives one row that says so) and a status line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, str(script), "--json", str(out)], cwd=REPO, env=env,
                                  timeout=timeout)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f}s"
        took = time.monotonic() - t0
        try:
            rows = json.loads(out.read_text()) if out.exists() else []
        except json.JSONDecodeError as e:
            rows, rc = [], f"bad --json output ({e})"
    if rc != 0 or not rows:
        reason = f"exit {rc}" if rc != 0 else "no --json rows"
        rows = [*rows, {"figure": f"{script.name} did not finish: {reason}", "pass": False}]
    return [{**r, "script": script.name} for r in rows], f"{script.name}: {len(rows)} figure(s) in {took:.1f}s"


def fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def report(rows: list[dict], status: list[str]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark report",
        "",
        f"Written by `make bench` (bench/run_all.py) on {now}: Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPU(s). Each figure and its baseline are measured in the "
        "same run.",
        "",
        "| figure | value | baseline | ratio | target | result | script |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = fmt(r.get("baseline"), r.get("unit", ""))
        if r.get("baseline_label") and r.get("baseline") is not None:
            base += f" ({r['baseline_label']})"
        result = {True: "pass", False: "MISS", None: "-"}[r.get("pass")]
        lines.append(f"| {r['figure']} | {fmt(r.get('value'), r.get('unit', ''))} | {base} | "
                     f"{fmt(r.get('ratio'))} | {r.get('target') or '-'} | {result} | {r['script']} |")
    lines += ["", *[f"- {s}" for s in status], ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="script names without .py (default: all)")
    ap.add_argument("--out", default=str(HERE / "REPORT.md"), help="markdown report (default bench/REPORT.md)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a figure misses its target")
    args = ap.parse_args()
    rows, status = [], []
    for script in scripts(args.only):
        print(f"== {script.name}", flush=True)
        got, line = run(script, args.timeout)
        rows += got
        status.append(line)
    Path(args.out).write_text(report(rows, status))
    missed = [r["figure"] for r in rows if r.get("pass") is False]
    print(f"\nwrote {args.out}: {len(rows)} figure(s), {len(missed)} missed")
    for figure in missed:
        print(f"  MISS: {figure}")
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
