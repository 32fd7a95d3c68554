"""Ctrl-C is a notice for every trainer integration, as for `spotguard.Guard`: a SIGINT to `spotguard run`
(forwarded to the job) stops the trainer after the current step with a committed emergency checkpoint and
exit 75. Before, HF and Accelerate died of KeyboardInterrupt (130) and Lightning exited 1, every step lost.
"""

from __future__ import annotations

import signal
import sys

import pytest

from .. import helpers
from . import runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARGS = ("--steps", "40", "--every-steps", "0", "--interval", "0.2", *runs.SLOW)


@pytest.mark.parametrize("script", ["hf_trainer.py", "accelerate_train.py", "lightning_train.py"])
def test_sigint_to_spotguard_run_stops_the_trainer_with_a_checkpoint(tmp_path, script):
    args = (*ARGS, "--output-dir", str(tmp_path / "hf-output")) if script == "hf_trainer.py" else ARGS
    cmd = [
        sys.executable,
        "-m",
        "spotguard",
        "run",
        "--max-restarts",
        "0",
        "--",
        *runs.command(script, tmp_path, *args),
    ]
    proc = helpers.stop_when(
        cmd, helpers.after_step(tmp_path / "losses.jsonl", 3), helpers.signal_to(signal.SIGINT), cwd=tmp_path
    )
    assert "SIGINT received: forwarding it to the job" in proc.stderr
    stopped = runs.assert_stopped(proc, tmp_path)  # exit 75, the emergency checkpoint of the last step
    assert 3 <= stopped < 40 and "not restarting, exiting 75" in proc.stderr
