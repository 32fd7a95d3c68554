"""Shared by bench scripts: build the rows bench/run_all.py collects, print them, write --json."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def row(
    figure: str,
    value: float,
    unit: str = "",
    *,
    baseline: float | None = None,
    baseline_label: str = "",
    target: str | None = None,
    passed: Callable[[float, float | None], bool] | None = None,
) -> dict:
    """One figure; ``passed(value, ratio)`` decides pass/miss against ``target``."""
    ratio = value / baseline if baseline not in (None, 0) else None
    return {
        "figure": figure,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": ratio,
        "target": target,
        "pass": None if passed is None else bool(passed(value, ratio)),
    }


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (for bench/run_all.py)")
    return ap


def emit(rows: list[dict], json_path: str | None) -> None:
    print(f"{'figure':<58}{'value':>12}{'baseline':>12}{'ratio':>8}  target")
    for r in rows:
        base = "-" if r["baseline"] is None else f"{r['baseline']:.4g}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        mark = {True: "pass", False: "MISS", None: ""}[r["pass"]]
        print(f"{r['figure']:<58}{r['value']:>12.4g}{base:>12}{ratio:>8}  {r['target'] or '-'} {mark}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
