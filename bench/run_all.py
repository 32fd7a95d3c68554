"""``make bench``: run every ``bench/*.py`` and write one markdown table, bench/REPORT.md.

Convention for a benchmark script: it prints its own table for people, and when given
``--json PATH`` it also writes a JSON list of rows there, one per figure::

    {"figure": "...", "value": 0.93, "unit": "goodput", "baseline": 0.90, "baseline_label": "...",
     "ratio": 1.03, "target": "ratio >= 1", "pass": true}

``baseline``, ``ratio``, ``target`` and ``pass`` may be null (a figure without a baseline or target).
The rows are kept in bench/report.json (re-running some scripts replaces only their rows), and
bench/REPORT.md, the project's one table of figures, is rewritten from all of them. The README and
docs/ link to the report instead of copying figures, so no copy goes stale.
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
ROWS = HERE / "report.json"


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
            proc = subprocess.run([sys.executable, str(script), "--json", str(out)], cwd=REPO, env=env, timeout=timeout)
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


def table(rows: list[dict]) -> list[str]:
    lines = ["| figure | value | baseline | ratio | target | result | script |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = fmt(r.get("baseline"), r.get("unit", ""))
        if r.get("baseline_label") and r.get("baseline") is not None:
            base += f" ({r['baseline_label']})"
        result = {True: "pass", False: "MISS", None: "-"}[r.get("pass")]
        lines.append(
            f"| {r['figure']} | {fmt(r.get('value'), r.get('unit', ''))} | {base} | "
            f"{fmt(r.get('ratio'))} | {r.get('target') or '-'} | {result} | {r['script']} |"
        )
    return lines


def report(rows: list[dict], status: list[str], machine: str) -> str:
    intro = [
        "# Benchmark report",
        "",
        "Written by `make bench` (bench/run_all.py) from bench/report.json: edit the scripts, not this file. "
        '`make bench` runs every script in `bench/`; `make bench ONLY="storage emergency"` re-runs some '
        "and keeps the other rows. Each row gives our figure, a baseline measured in the same run, the "
        "ratio, the target, and pass or MISS when the figure misses its target.",
        "",
        f"Measured {machine}. A shared or loaded machine makes the figures noisy: re-run `make bench` on "
        'your hardware (`make bench BENCH_MACHINE="..."` records words about it here).',
        "",
    ]
    return "\n".join([*intro, *table(rows), "", *[f"- {s}" for s in status], ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="script names without .py (default: all)")
    ap.add_argument("--out", default=str(HERE / "REPORT.md"), help="markdown report (default bench/REPORT.md)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a figure misses its target")
    ap.add_argument("--machine", default="", help="words about the machine, e.g. 'shared 2-core VM, no GPU'")
    args = ap.parse_args()
    if args.only and not ROWS.exists():
        ap.error(f"{ROWS.name} is missing: run every benchmark once (make bench) before some of them")
    previous = json.loads(ROWS.read_text()) if ROWS.exists() else {"rows": [], "status": {}}
    ran, rows, status = [], [], dict(previous["status"])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    for script in scripts(args.only):
        print(f"== {script.name}", flush=True)
        got, line = run(script, args.timeout)
        ran.append(script.name)
        rows += got
        status[script.name] = f"{line} on {now}"
    # Rows of scripts not run this time are kept (``make bench ONLY=agreement`` refreshes one script).
    rows = sorted([r for r in previous["rows"] if r["script"] not in ran] + rows, key=lambda r: r["script"])
    machine = (
        f"on {now}, Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU(s)"
        f"{', ' + args.machine if args.machine else ''}"
    )
    ROWS.write_text(json.dumps({"rows": rows, "status": status}, indent=1) + "\n")
    Path(args.out).write_text(report(rows, [status[k] for k in sorted(status)], machine))
    missed = [r["figure"] for r in rows if r.get("pass") is False]
    print(f"\nwrote {args.out}: {len(rows)} figure(s), {len(missed)} missed")
    for figure in missed:
        print(f"  MISS: {figure}")
    return 1 if missed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
