"""`spotguard run` with real processes: crashes and hangs are restarted and resume exactly,
preemptions are not restarted, and a job that keeps failing ends with a clear error.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.errors import ConfigError
from spotguard.ops.supervisor import SupervisorOptions
from tests.forked import behind, launched
from tests.helpers import (
    EXAMPLE,
    EXAMPLE_ARGS,
    after_step,
    assert_same_run,
    read_losses,
    run,
    signal_to,
    stop_when,
    subprocess_env,
)

pytestmark = pytest.mark.slow

ARGS = (*EXAMPLE_ARGS, "--num-workers", "0")  # the same reference run as tests/guard/test_resume.py
_rng = random.Random()


def run_cmd(storage: Path, *supervisor_args: str, child: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "spotguard",
        "run",
        "-v",  # the run's INFO lines (each start, the newest checkpoint) the tests read
        "--storage",
        str(storage),
        "--backoff",
        "0.05",
        *supervisor_args,
        "--",
        *child,
    ]


@pytest.fixture(scope="module", autouse=True)
def _forked():
    """The example's jobs under `spotguard run` fork from one server that imported it (tests/forked.py)."""
    with behind(EXAMPLE):
        yield


def example(*args: str) -> list[str]:
    """The example without --storage: it must get the location from `spotguard run`."""
    return [sys.executable, *launched(EXAMPLE), "--quiet", *args]


def supervise(cmd: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    return run(cmd, env=subprocess_env(**env), timeout=timeout)


def test_crash_at_random_step_is_restarted_and_resumes_exactly(tmp_path, reference_runs):
    reference = reference_runs(*ARGS)
    at = _rng.randint(2, 85)
    losses, final, storage = tmp_path / "losses.jsonl", tmp_path / "final.pt", tmp_path / "ckpt"
    proc = supervise(
        run_cmd(
            storage,
            child=example(
                *ARGS,
                "--losses",
                str(losses),
                "--final",
                str(final),
                "--crash-at-step",
                str(at),
                "--fault-marker",
                str(tmp_path / "crashed"),
            ),
        )
    )
    assert proc.returncode == 0, (at, proc.stderr)
    assert "simulated crash at step" in proc.stderr and "crashed with exit code 1" in proc.stderr, at
    # The newest periodic checkpoint (every 20 steps) at or before the crash; on a loaded machine a
    # save may have been skipped while the previous one was still being written, so it can be older.
    found = re.search(r"newest checkpoint: step (\d+) \(periodic\)", proc.stderr)
    resumed = int(found.group(1)) if found else 0
    assert resumed % 20 == 0 and resumed <= at, (at, proc.stderr)
    if resumed:
        assert f"resuming at step {resumed} of" in proc.stdout, (at, proc.stdout)
    else:
        assert proc.stdout.count("starting at step 0 of") == 2, (at, proc.stdout)
    assert proc.stderr.count("starting: ") == 2
    assert_same_run(losses, final, reference)


def test_hang_is_detected_within_the_timeout_dumped_and_resumed(tmp_path, reference_runs):
    reference = reference_runs(*ARGS)
    at, timeout = _rng.randint(21, 85), 2.0
    losses, final, storage = tmp_path / "losses.jsonl", tmp_path / "final.pt", tmp_path / "ckpt"
    proc = supervise(
        run_cmd(
            storage,
            "--hang-timeout",
            str(timeout),
            "--startup-timeout",
            "60",
            child=example(
                *ARGS,
                "--losses",
                str(losses),
                "--final",
                str(final),
                "--hang-at-step",
                str(at),
                "--fault-marker",
                str(tmp_path / "hung"),
            ),
        )
    )
    assert proc.returncode == 0, proc.stderr
    # The supervisor's own measure, from the last heartbeat change (the test's polling would add its own delays):
    # past the timeout, and not much later (it checks a few times a second; slack for a busy 2-core box).
    found = re.search(r"no step completed for ([0-9.]+)s \(after step (\d+)\)", proc.stderr)
    assert found and int(found.group(2)) == at, proc.stderr[-3000:]
    assert timeout <= float(found.group(1)) <= timeout + 5.0, found.group(0)
    assert "in simulated_hang" in proc.stderr and "Current thread" in proc.stderr  # faulthandler's dump of the child
    assert f"resuming at step {at // 20 * 20} of" in proc.stdout
    assert_same_run(losses, final, reference)


def test_preemption_exits_with_the_preemption_code_and_is_not_restarted(tmp_path):
    losses, storage = tmp_path / "losses.jsonl", tmp_path / "ckpt"
    cmd = run_cmd(storage, child=example(*ARGS, "--losses", str(losses), "--step-sleep", "0.03"))
    # SIGTERM to the supervisor: it forwards it to the job
    proc = stop_when(cmd, after_step(losses, _rng.randint(3, 60)), signal_to(signal.SIGTERM))
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "forwarding it to the job" in err and "not restarting" in err
    assert err.count("starting: ") == 1 and "stopped at step" in out
    stopped = read_losses(losses)[-1][0]
    assert (storage / f"step-{stopped:08d}" / "manifest.json").exists()  # the emergency checkpoint


def test_a_job_that_stops_for_its_own_notice_is_not_restarted_whatever_its_exit_code(tmp_path):
    """The Guard's heartbeat flag tells the supervisor, even when the script exits 0 after the stop."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        import spotguard
        guard = spotguard.Guard(every_steps=None, providers="file", interval=0.05)
        with guard:
            for step in range(1, 10_000):
                time.sleep(0.01)
                if step == 5:
                    open(os.environ["SPOTGUARD_NOTICE_FILE"], "w").close()
                if guard.step(step):
                    break
        sys.exit(0)
    """)
    )
    proc = supervise(
        run_cmd(tmp_path / "ckpt", child=[sys.executable, str(script)]), SPOTGUARD_NOTICE_FILE=str(tmp_path / "notice")
    )
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr
    assert "stopped for a notice (exit code 0)" in proc.stderr and proc.stderr.count("starting: ") == 1


def test_restart_budget_exhausted_ends_with_a_clear_error(tmp_path):
    proc = supervise(
        run_cmd(tmp_path / "ckpt", "--max-restarts", "2", child=[sys.executable, "-c", "import sys; sys.exit(3)"])
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("starting: ") == 3
    assert "restart 1 of 2 in 0.05s" in proc.stderr and "restart 2 of 2 in 0.1s" in proc.stderr
    assert (
        "spotguard: error: the job crashed with exit code 3 and the restart budget is used up (2 restart(s))"
        in proc.stderr
    )


def test_a_job_that_ignores_the_forwarded_signal_is_killed_after_the_grace_period(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        run_cmd(tmp_path / "ckpt", "--grace", "1", child=[sys.executable, str(script)]),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert 1.0 <= time.monotonic() - t0 < 10, err
    assert "did not exit within 1s" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_job_killed_by_the_forwarded_signal_exits_128_plus_the_signal(tmp_path, sig):
    """The child does not trap the signal and dies of it: the supervisor exits as a shell would
    report that death (143 for SIGTERM), not with Popen's -N (which sys.exit turns into 256-N)."""
    child = ["sh", "-c", "echo ready; exec sleep 60"]
    proc = subprocess.Popen(
        run_cmd(tmp_path / "ckpt", child=child),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"exited with code {128 + sig} after a stop signal" in err


def test_a_job_killed_by_a_signal_is_a_crash_reported_as_128_plus_the_signal(tmp_path):
    proc = supervise(run_cmd(tmp_path / "ckpt", "--max-restarts", "0", child=["sh", "-c", "kill -KILL $$"]))
    assert proc.returncode == 2, proc.stderr
    assert "the job was killed by SIGKILL (exit code 137) and the restart budget is used up" in proc.stderr


def test_a_broadcast_stop_reaches_the_job_once_per_signal_with_forward_as(tmp_path):
    """Slurm preemption signals every process: the job gets SIGTERM directly, the supervisor gets it
    twice (directly and from the batch shell's trap) and forwards one SIGUSR1. No signal reaches
    the job twice, so its Guard does not read it as "stop now"."""
    got = tmp_path / "signals.txt"
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal, sys, time
        def record(signum, frame):
            open({str(got)!r}, "a").write(signal.Signals(signum).name + "\\n")
        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGUSR1, record)
        print("ready", flush=True)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit({EXIT_PREEMPTED})
    """)
    )
    proc = subprocess.Popen(
        run_cmd(tmp_path / "ckpt", "--forward-as", "USR1", child=[sys.executable, str(script)]),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    child = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
    os.kill(child, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert sorted(got.read_text().split()) == ["SIGTERM", "SIGUSR1"], err


@pytest.mark.parametrize(
    "bad",
    [
        dict(command=[]),
        dict(command=["x"], max_restarts=-1),
        dict(command=["x"], hang_timeout=0),
        dict(command=["x"], backoff=5, backoff_max=1),
        dict(command=["x"], forward_as="SIGNOPE"),
    ],
)
def test_bad_options_are_rejected(bad):
    with pytest.raises(ConfigError):
        SupervisorOptions(**bad)


def test_prefetch_copies_the_newest_checkpoint_into_the_local_tier_and_the_job_resumes_from_it(tmp_path):
    import torch

    import spotguard
    from spotguard import checkpoint
    from spotguard.ops.supervisor import Supervisor, SupervisorOptions
    from spotguard.storage import open_storage

    durable, local = tmp_path / "bucket", tmp_path / "nvme"
    g = spotguard.Guard(str(durable), providers=[]).track(model=torch.nn.Linear(3, 3))
    g.save(7, "periodic")
    seen = tmp_path / "env.txt"
    cmd = [sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write(os.environ['SPOTGUARD_LOCAL_DIR'])"]
    code = Supervisor(SupervisorOptions(cmd, storage=str(durable), local_dir=str(local), prefetch=True)).run()
    assert code == 0 and seen.read_text() == str(local)
    (info,) = checkpoint.scan(open_storage(str(local)))
    assert info.complete and info.step == 7
    checkpoint.verify(open_storage(str(local)), info)
    # Guard reads $SPOTGUARD_LOCAL_DIR; with the durable copy gone, the local copy alone resumes.
    checkpoint.delete(open_storage(str(durable)), "step-00000007")
    os.environ["SPOTGUARD_LOCAL_DIR"] = str(local)
    try:
        fresh = spotguard.Guard(str(durable), providers=[]).track(model=torch.nn.Linear(3, 3))
        assert fresh.local is not None and fresh.resume() == 7
    finally:
        del os.environ["SPOTGUARD_LOCAL_DIR"]
    with pytest.raises(spotguard.ConfigError, match="--local-dir"):
        SupervisorOptions(["true"], prefetch=True)


def test_startup_timeout_alone_kills_a_job_that_never_reaches_its_first_step(tmp_path):
    t0 = time.monotonic()
    proc = supervise(
        run_cmd(
            tmp_path / "ckpt",
            "--startup-timeout",
            "1",
            "--max-restarts",
            "0",
            child=[sys.executable, "-c", "import time; time.sleep(30)"],
        ),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no step completed for" in proc.stderr and "(since the start)" in proc.stderr
    assert "the job hung and the restart budget is used up" in proc.stderr
    assert time.monotonic() - t0 < 25


def test_startup_timeout_alone_does_not_watch_later_steps(tmp_path):
    """Without --hang-timeout a job that made its first step may take as long as it likes. The child
    writes step 1 into the heartbeat as guard.step(1) does (without torch's import time)."""
    script = (
        "import os, struct, time\nwith open(os.environ['SPOTGUARD_HEARTBEAT'], 'r+b') as f:\n"
        "    f.write(struct.pack('=qq', 1, 0))\ntime.sleep(7)\n"
    )
    proc = supervise(
        run_cmd(
            tmp_path / "ckpt", "--startup-timeout", "5", "--max-restarts", "0", child=[sys.executable, "-c", script]
        ),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no step completed" not in proc.stderr


def test_prefetch_refuses_a_corrupt_checkpoint_and_the_job_starts_anyway(tmp_path):
    from spotguard import checkpoint
    from spotguard.ops.supervisor import Supervisor, SupervisorOptions
    from spotguard.storage import open_storage

    durable, local = tmp_path / "bucket", tmp_path / "nvme"
    checkpoint.write(open_storage(str(durable)), 7, {"state.pt": lambda f: f.write(b"x" * 4096)}, reason="periodic")
    with open(durable / "step-00000007" / "state.pt", "r+b") as f:
        f.write(b"y")  # same size: only the checksum tells
    code = Supervisor(
        SupervisorOptions([sys.executable, "-c", "pass"], storage=str(durable), local_dir=str(local), prefetch=True)
    ).run()
    assert code == 0
    assert not any(i.complete for i in checkpoint.scan(open_storage(str(local))))
