"""examples/tracker_run_id.py: the tracker's run id survives a preemption in ``guard.extra``."""

from __future__ import annotations

import signal
import sys

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage

from .helpers import REPO, read_jsonl, run, signal_to, stop_when

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "tracker_run_id.py"


def tracked(path) -> list[dict]:
    return read_jsonl(path)


def test_the_run_id_is_kept_across_a_preemption_and_the_run_continues(tmp_path):
    storage, log = tmp_path / "ckpt", tmp_path / "tracker.jsonl"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--storage",
        str(storage),
        "--tracker-log",
        str(log),
        "--steps",
        "80",
        "--every-steps",
        "20",
        "--providers",
        "signal",
    ]
    proc = stop_when(
        [*cmd, "--step-sleep", "0.02"],
        lambda: any(r.get("step", 0) >= 30 for r in tracked(log)),
        signal_to(signal.SIGTERM),
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, err
    first = tracked(log)
    run_id = first[0]["run_id"]
    assert first[0] == {"run_id": run_id, "resumed": False, "start_step": 0} and f"new tracker run {run_id}" in out
    stopped = first[-1]["step"]
    (emergency,) = [i for i in scan(open_storage(str(storage))) if i.manifest.reason == "emergency"]
    assert emergency.step == stopped and emergency.manifest.extra == {"tracker_run_id": run_id}

    second = run(cmd)
    assert second.returncode == 0, second.stderr
    assert f"continuing tracker run {run_id} at step {stopped}" in second.stdout
    records = tracked(log)
    assert {r["run_id"] for r in records} == {run_id}  # one run in the tracker, not two
    assert records[len(first)] == {"run_id": run_id, "resumed": True, "start_step": stopped}
    assert [r["step"] for r in records if "step" in r] == list(range(1, 81))  # nothing repeated or missed
