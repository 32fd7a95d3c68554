"""kill -9 at random moments of background saves, fifty times: every resume valid and exact."""

from __future__ import annotations

import json
import random
import sys

import pytest

from tests.helpers import WORKERS, read_losses, run

pytestmark = pytest.mark.slow
DRIVER = WORKERS / "crash_driver.py"


def test_fifty_kills_during_async_saves_never_corrupt_a_resume(tmp_path):
    ref_log = tmp_path / "ref.jsonl"
    ref = run([sys.executable, str(DRIVER), "--reference", str(tmp_path / "ref"), str(ref_log)])
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = dict(read_losses(ref_log))
    seed = random.randrange(2**32)
    log = tmp_path / "log.jsonl"
    proc = run([sys.executable, str(DRIVER), str(tmp_path / "ckpt"), str(log), "50", str(seed)], timeout=400)
    assert proc.returncode == 0, (seed, proc.stderr[-3000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["corrupt"] == 0 and summary["final_status"] == 0, (seed, summary)
    assert summary["partial"] >= 5, (seed, summary)  # many kills landed inside a background save
    # Scratch files of killed saves are swept by the next save, and unfinished step-N/ older than
    # the resume point by the next resume: storage does not fill up with partial states.
    assert summary["most_scratch"] <= 1 and summary["scratch_left"] == 0, (seed, summary)
    assert summary["incomplete_left"] == 0, (seed, summary)
    logged = read_losses(log)
    for step, loss in logged:  # every replayed step equals the uninterrupted run
        assert loss == reference[step], (seed, step)
    assert {s for s, _ in logged} == set(reference)
