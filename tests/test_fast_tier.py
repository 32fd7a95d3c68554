"""``make test-fast`` takes the files that took seconds in the last full run, and leaves the rest to ``make test``."""

from __future__ import annotations

import json

from tests import fast_tier, xdist_order


def test_the_tier_keeps_quick_files_and_leaves_process_heavy_ones_out():
    measured = json.loads(xdist_order.FILE_SECONDS.read_text())
    chosen = fast_tier.files()
    assert chosen and all(s <= fast_tier.FAST_FILE_S for s in chosen.values())
    heavy = [f for f, s in measured.items() if s > fast_tier.FAST_FILE_S]
    assert heavy and not set(heavy) & set(chosen)
    assert "tests/test_planner.py" in chosen


def test_a_file_the_last_run_never_saw_is_weighed_by_its_slow_tests(tmp_path, monkeypatch):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_quick.py").write_text("def test_a():\n    pass\n")
    (tests / "test_heavy.py").write_text("import pytest\npytestmark = pytest.mark.slow\n\ndef test_a():\n    pass\n")
    monkeypatch.setattr(fast_tier, "ROOT", tmp_path)
    assert set(fast_tier.files()) == {"tests/test_quick.py"}
