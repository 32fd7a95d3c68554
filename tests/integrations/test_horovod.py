"""examples/horovod/train_horovod.py under `horovodrun -np 2 --gloo`: a notice file for rank 1 stops both
ranks after the same step with one committed checkpoint, and the next horovodrun resumes it exactly
(every step's loss on both ranks, the final weights and optimizer state, bit for bit).

Horovod is not a dependency: its last release (0.28.1) builds against torch 2.1+ only with its C++
standard raised to 17 (docs/distributed.md, "Horovod"). The test runs where the Python named by
``$HOROVOD_PYTHON`` (default: this one) imports ``horovod.torch`` and ``torchdata`` and has ``horovodrun``
beside it (spotguard comes from this checkout; its own dependencies must be installed there too), and is
skipped elsewhere, CI included.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage

from ..helpers import REPO, after_step, assert_same_run, read_losses, run, stop_when, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PYTHON = os.environ.get("HOROVOD_PYTHON", sys.executable)
SCRIPT = REPO / "examples" / "horovod" / "train_horovod.py"
STEPS = 60  # 32 batches per epoch and rank: the run crosses an epoch end
ARGS = ("--steps", str(STEPS), "--every-steps", "20", "--interval", "0.2")
_rng = random.Random()


def _horovod_missing() -> str | None:
    missing = f"no horovodrun + horovod.torch + torchdata for {PYTHON} (set $HOROVOD_PYTHON)"
    if not (Path(PYTHON).parent / "horovodrun").exists():
        return missing
    check = subprocess.run([PYTHON, "-c", "import horovod.torch, torchdata"], capture_output=True)
    return missing if check.returncode != 0 else None


@pytest.fixture(scope="module", autouse=True)
def _needs_horovod():
    missing = _horovod_missing()
    if missing:
        pytest.skip(missing)


def _cmd(run_dir: Path, *args: str) -> list[str]:
    return [
        str(Path(PYTHON).parent / "horovodrun"),
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        PYTHON,
        str(SCRIPT),
        "--storage",
        str(run_dir / "ckpt"),
        "--losses",
        str(run_dir / "losses-{rank}.jsonl"),
        "--final",
        str(run_dir / "final.pt"),
        *ARGS,
        *args,
    ]


def test_horovod_notice_to_one_rank_stops_both_and_resumes_identically(tmp_path):
    ref = tmp_path / "reference"
    ref.mkdir()
    done = run(_cmd(ref))
    assert done.returncode == 0, done.stderr[-4000:]

    cut = tmp_path / "cut"
    cut.mkdir()
    env = subprocess_env(SPOTGUARD_NOTICE_FILE=str(cut / "notice-{rank}"))
    at = _rng.randint(5, 40)
    first = stop_when(
        _cmd(cut, "--step-sleep", "0.05"),
        after_step(cut / "losses-1.jsonl", at),
        lambda proc: (cut / "notice-1").touch(),
        env=env,
    )
    out = first.stdout + first.stderr  # horovodrun prefixes the ranks' lines with [rank]<stream>
    assert first.returncode != 0  # horovodrun reports a rank's non-zero exit as a failure of its own
    assert f"Exit code: {EXIT_PREEMPTED}" in out, out[-4000:]
    assert "[1]<stderr>:stop notice from file" in out and "[0]<stderr>:stop notice from peer" in out, out[-4000:]
    stopped = {read_losses(cut / f"losses-{rank}.jsonl")[-1][0] for rank in (0, 1)}
    assert len(stopped) == 1, stopped  # both ranks after the same step
    (step,) = stopped
    assert at <= step < STEPS
    (info,) = [i for i in scan(open_storage(str(cut / "ckpt"))) if i.step == step]
    assert info.complete and info.manifest is not None and info.manifest.reason == "emergency", info

    (cut / "notice-1").unlink()
    last = run(_cmd(cut), env=env)
    assert last.returncode == 0, last.stderr[-4000:]
    for rank in (0, 1):
        reference = (read_losses(ref / f"losses-{rank}.jsonl"), ref / "final.pt")
        assert_same_run(cut / f"losses-{rank}.jsonl", cut / "final.pt", reference)
