"""``--dist loadfile``, longest files first: the suite's wall time is the busier worker's.

pytest-xdist hands out whole files in order of their number of tests, so files of one or two
minute-long tests (Ray, the teardown chains) came last and one worker ran them alone while the
other sat idle. Here the queue gives out the file expected to take longest first (the classic
longest-processing-time order), so both workers end on short files at about the same time.

A file's expected seconds: the sum of its tests' durations in the last run here that ran them
(pytest's cache, ``.pytest_cache``); else (a fresh checkout, CI) its seconds in ``file_seconds.json``
(a full run on the 2-core machine; refresh it with ``python -m tests.xdist_order`` after one); else,
for a new file, a guess from its source: a few seconds per test marked ``slow``. Files still go whole to one worker, so a
module-scoped fixture (a reference run shared by a file's tests) is computed once, as before.
"""

from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

CACHE_KEY = "spotguard/test-seconds"
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
SLOW_GUESS_S = 8.0  # a test marked slow runs processes: seconds each
FAST_GUESS_S = 0.05


def guess_seconds(path: Path, tests: int) -> float:
    """Seconds a file never timed here may take, from its source: its ``slow`` tests dominate."""
    try:
        text = path.read_text()
    except OSError:
        return tests * FAST_GUESS_S
    if re.search(r"^pytestmark\s*=.*\bslow\b", text, re.M):
        slow = len(re.findall(r"^\s*(?:async\s+)?def test_", text, re.M))
    else:
        slow = len(re.findall(r"^\s*@pytest\.mark\.slow\b", text, re.M))
    return min(slow, tests) * SLOW_GUESS_S + tests * FAST_GUESS_S


class _HeaviestFirst(OrderedDict):
    """xdist's queue of work units (file -> {test id: done}); ``popitem(last=False)`` gives the heaviest."""

    def __init__(self, weigh) -> None:
        super().__init__()
        self._weigh = weigh

    def popitem(self, last: bool = True):
        if last or not self:
            return super().popitem(last)
        scope = max(self, key=lambda s: self._weigh(s, self[s]))
        return scope, self.pop(scope)


def make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadFileScheduling

    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    seconds: dict[str, float] = cache.get(CACHE_KEY, {}) if cache else {}
    measured: dict[str, float] = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    weights: dict[str, float] = {}

    def weigh(scope: str, unit: dict[str, bool]) -> float:
        if scope not in weights:
            known = [seconds[t] for t in unit if t in seconds]
            if known and len(known) * 2 >= len(unit):
                weights[scope] = sum(known) / len(known) * len(unit)
            elif scope in measured:
                weights[scope] = measured[scope]
            else:
                weights[scope] = guess_seconds(config.rootpath / scope.split("::")[0], len(unit))
        return weights[scope]

    class LongestFileFirst(LoadFileScheduling):
        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            self.workqueue = _HeaviestFirst(weigh)

    return LongestFileFirst(config, log)


class Durations:
    """Records each test's seconds (setup, call and teardown) in the controller, for the next run's order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(session.config, "cache", None)
        if cache is None or not self.seconds:
            return
        merged = {**cache.get(CACHE_KEY, {}), **{k: round(v, 2) for k, v in self.seconds.items()}}
        cache.set(CACHE_KEY, merged)


def write_file_seconds(cache_dir: Path) -> None:
    """``file_seconds.json`` from the test durations in ``cache_dir`` (the last full run's)."""
    seconds = json.loads((cache_dir / "v" / CACHE_KEY).read_text())
    files: dict[str, float] = {}
    for test, s in seconds.items():
        file = test.split("::")[0]
        files[file] = files.get(file, 0.0) + s
    ordered = dict(sorted(((f, round(s, 1)) for f, s in files.items()), key=lambda fs: -fs[1]))
    FILE_SECONDS.write_text(json.dumps(ordered, indent=0) + "\n")


if __name__ == "__main__":
    write_file_seconds(Path(sys.argv[1] if len(sys.argv) > 1 else ".pytest_cache"))
