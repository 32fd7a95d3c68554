"""``make test-fast``: the edit loop's tier, the test files that take seconds, without their slow tests.

Which files: those whose tests took at most ``FAST_FILE_S`` seconds in all in the last full run
(``file_seconds.json``, refreshed by ``python -m tests.xdist_order``), or, for a file that run never
saw, by the guess ``xdist_order`` makes from its source. Only those files are collected, so a tier
run does not import Lightning, Ray or DeepSpeed for files it leaves out. ``make test`` and CI run
everything; this tier misses the launchers, the clusters and the trainers' real runs.

``python -m tests.fast_tier [pytest args]`` runs it; ``--list`` prints the files and their seconds.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.xdist_order import FILE_SECONDS, guess_seconds

FAST_FILE_S = 8.0  # a file's seconds in the last full run (the 2-core machine)
ROOT = Path(__file__).resolve().parent.parent


def files() -> dict[str, float]:
    """The tier's files (relative to the repository) and their expected seconds."""
    measured: dict[str, float] = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    chosen = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "node_modules" in rel:
            continue
        if rel in measured:
            seconds = measured[rel]
        else:
            tests = len(re.findall(r"^\s*(?:async\s+)?def test_", path.read_text(), re.M))
            seconds = guess_seconds(path, tests)
        if seconds <= FAST_FILE_S:
            chosen[rel] = seconds
    return chosen


def main(argv: list[str]) -> int:
    chosen = files()
    if "--list" in argv:
        for rel, seconds in sorted(chosen.items(), key=lambda fs: -fs[1]):
            print(f"{seconds:7.1f} s  {rel}")
        print(f"{len(chosen)} files, {sum(chosen.values()):.0f} s of tests in the last full run")
        return 0
    import pytest

    return int(pytest.main(["-m", "not slow", *argv, *chosen]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
