"""`spotguard run` under repeated stop signals: a storm is one stop, and 75 means a committed checkpoint.

A real Guard job (tests/workers/slow_emergency.py) takes seconds to write its emergency checkpoint;
the signals go to the supervisor, as a platform's agent or a user sends them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from spotguard import EXIT_PREEMPTED, heartbeat
from spotguard.ops.supervisor import DUPLICATE_WINDOW, Outcome, Supervisor, SupervisorOptions
from tests.helpers import WORKERS, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def start(storage: Path, save_seconds: float) -> tuple[subprocess.Popen[str], tempfile._TemporaryFileWrapper[str]]:
    err = tempfile.NamedTemporaryFile("w+")
    cmd = [sys.executable, "-m", "spotguard", "run", "-v", "--storage", str(storage), "--max-restarts", "0", "--"]
    cmd += [sys.executable, str(WORKERS / "slow_emergency.py"), str(save_seconds)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != "ready\n":
        proc.kill()
        proc.wait()
        err.seek(0)
        raise AssertionError(f"no ready line ({line!r}):\n{err.read()[-4000:]}")
    return proc, err


def finish(proc: subprocess.Popen[str], err: tempfile._TemporaryFileWrapper[str]) -> tuple[str, str]:
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    return out, err.read()


def manifests(storage: Path) -> list[str]:
    return sorted(p.parent.name for p in storage.glob("step-*/manifest.json"))


def test_a_sigterm_storm_during_the_emergency_checkpoint_is_one_stop_and_the_checkpoint_commits(tmp_path):
    """SIGTERM every 0.1 s for 6 s while the job saves for 4 s. The duplicate window used to count from
    the first signal: the repeat at 2 s went through as "stop now", killed the job mid-save, and the
    supervisor still exited 75. Counted from the latest signal the storm is one stop: the checkpoint
    commits, and 75 is true."""
    storage = tmp_path / "ckpt"
    proc, err = start(storage, save_seconds=4)
    t0, sent = time.monotonic(), 0
    while time.monotonic() - t0 < 6 and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.1)
    out, log = finish(proc, err)
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert manifests(storage) == [f"step-{stopped:08d}"], log
    assert proc.returncode == EXIT_PREEMPTED, log
    assert sent >= 30 and time.monotonic() - t0 > 2 * DUPLICATE_WINDOW, (sent, log)  # the storm outlasted the window
    assert f"emergency checkpoint of step {stopped} committed" in log
    assert log.count("SIGTERM again within") == 1 and "exited with code" not in log, log


def test_a_stop_repeated_after_a_quiet_window_kills_the_save_and_the_supervisor_does_not_claim_75(tmp_path):
    """A sender that insists (a second SIGTERM after the window) stops the job at once, mid-save: the job
    dies of it, nothing is committed, and `spotguard run` exits 143 with a line saying what was lost
    (it used to exit 75, "checkpoint written")."""
    storage = tmp_path / "ckpt"
    proc, err = start(storage, save_seconds=30)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None and proc.stdout.readline() == "saving\n"
    time.sleep(DUPLICATE_WINDOW + 0.5)
    proc.send_signal(signal.SIGTERM)
    _, log = finish(proc, err)
    assert proc.returncode == 128 + signal.SIGTERM, log
    assert manifests(storage) == [], log
    assert "reported no committed checkpoint (exit code 143): the resume point stays the start" in log, log


@pytest.mark.parametrize("code", [0, EXIT_PREEMPTED, 3])
def test_a_job_that_stopped_without_committing_never_gets_75_from_the_supervisor(tmp_path, code):
    """The README's loop exits 75 after a stop whatever the emergency save did: the heartbeat is the
    truth. Without COMMITTED the job's own code stands, 1 where it would claim a checkpoint or a finish."""
    sup = Supervisor(SupervisorOptions(["true"], storage=str(tmp_path / "ckpt")))
    sup.beat = heartbeat.create(tmp_path / "beat")
    assert sup._decide(Outcome(code, heartbeat.STOPPED_FOR_NOTICE)) == (3 if code == 3 else 1)
    assert sup._decide(Outcome(code, heartbeat.STOPPED_FOR_NOTICE | heartbeat.COMMITTED)) == EXIT_PREEMPTED
    assert sup.exits[0]["cause"] == "preempted" and not sup.exits[0]["restart"]
