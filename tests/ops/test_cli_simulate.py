"""``spotguard simulate-preemption --pid/--file`` with ``--clear`` and ``--in``: a notice file is removed or
written late, a signal is delayed, and a signal cannot be "cleared" (exit 2), never acted on at once by mistake."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from spotguard.ops.cli import main


def test_file_clear_removes_the_notice_file_and_says_so_when_there_is_none(tmp_path, capsys):
    flag = tmp_path / "notice.json"
    assert main(["simulate-preemption", "--file", str(flag)]) == 0 and flag.exists()
    capsys.readouterr()
    assert main(["simulate-preemption", "--file", str(flag), "--clear"]) == 0
    assert not flag.exists()  # was: a stop notice written instead
    assert capsys.readouterr().out == f"removed notice file {flag}\n"
    assert main(["simulate-preemption", "--file", str(flag), "--clear"]) == 0
    assert capsys.readouterr().out == f"no notice file {flag}: nothing to clear\n"
    assert list(tmp_path.iterdir()) == []


def test_file_in_waits_then_writes(tmp_path):
    flag = tmp_path / "notice.json"
    t0 = time.time()
    assert main(["simulate-preemption", "--file", str(flag), "--in", "0.5"]) == 0
    assert time.time() - t0 >= 0.5
    assert flag.stat().st_mtime >= t0 + 0.45  # was: written at once (mtime granularity allows a little)


def test_pid_clear_is_refused_and_sends_nothing(capsys):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert main(["simulate-preemption", "--pid", str(victim.pid), "--clear"]) == 2
        assert "cannot be withdrawn" in capsys.readouterr().err
        time.sleep(0.3)
        assert victim.poll() is None  # was: SIGTERM sent
    finally:
        victim.kill()
        victim.wait()


def test_pid_in_waits_then_signals():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        assert main(["simulate-preemption", "--pid", str(victim.pid), "--in", "0.5"]) == 0
        assert time.monotonic() - t0 >= 0.5
        assert victim.wait(10) == -signal.SIGTERM
    finally:
        victim.kill()
        victim.wait()


def test_a_negative_in_is_refused(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has: nothing can be hit if the check were missing
    assert main(["simulate-preemption", "--pid", str(gone.pid), "--in", "-1"]) == 2
    assert main(["simulate-preemption", "--file", str(tmp_path / "n"), "--in", "nan"]) == 2
    assert capsys.readouterr().err.count("--in must be 0 or more seconds") == 2
    assert list(tmp_path.iterdir()) == []
