"""tests/forkexec.py through a ``tests.forked.behind`` server: a launcher sees the forked run as it would
see ``python SCRIPT``: its arguments, environment, folder and streams, its exit code or signal, the
signals sent to it; and a killed stand-in takes its run with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.forked import SOCKET_ENV, Served, behind, via
from tests.helpers import run, subprocess_env, torchrun, wait_until

JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"), "in", sys.stdin.read(), flush=True)
    print("err", os.getpid(), file=sys.stderr, flush=True)
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "code":
        sys.exit(int(arg))
    if mode == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("got TERM", flush=True), sys.exit(7)))
    open(arg, "w").write(str(os.getpid()))
    time.sleep(60)
    """
)


@pytest.fixture(scope="module")
def server():
    with behind(preload=("json",)) as s:
        yield s


def _job(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path / "job.py"


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] == "Z"


def test_a_forked_run_gets_the_launchers_arguments_environment_folder_and_streams(server, tmp_path):
    done = subprocess.run(
        via(_job(tmp_path), "code", "3", server=server),
        env=subprocess_env(X="42"),
        cwd=tmp_path,
        input="hi",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == f"argv ['code', '3'] cwd {tmp_path} X 42 in hi\n"
    pid = int(done.stderr.split()[1])
    assert pid != os.getpid() and "err" in done.stderr


def _started(server, tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    """The stand-in of a run in ``mode`` ("term", "sleep"), once the run wrote its pid; both pids."""
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(
        via(_job(tmp_path), mode, pid_file, server=server),
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", "the run's start")
    return proc, int(pid_file.read_text())


def test_a_signal_to_the_stand_in_reaches_the_run_and_its_exit_comes_back(server, tmp_path):
    proc, _ = _started(server, tmp_path, "term")
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 7 and out.endswith("got TERM\n"), out


def test_a_run_killed_by_a_signal_kills_its_stand_in_by_the_same(server, tmp_path):
    proc, run = _started(server, tmp_path, "sleep")
    os.kill(run, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_stand_in_takes_its_run_with_it(server, tmp_path):
    proc, run = _started(server, tmp_path, "sleep")
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while not _gone(run):
        assert time.monotonic() < deadline, "the run outlived its stand-in"
        time.sleep(0.01)


def test_without_a_server_the_stand_in_is_the_script(tmp_path):
    proc = subprocess.Popen(
        via(_job(tmp_path), "code", "4"),
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4 and "X None" in out, err
    assert int(err.split()[1]) == proc.pid  # exec'd: the stand-in's own process ran it


def test_a_server_started_where_the_socket_variable_is_set_runs_its_own_runs(server, tmp_path, monkeypatch):
    monkeypatch.setenv(SOCKET_ENV, str(server.socket))  # as in a listening server's own children
    job, served = _job(tmp_path), Served(("json",))
    try:
        with served.scripts(job):  # its environment names the listening server's socket: not to be taken
            done = run([sys.executable, str(job), "code", "5"], cwd=tmp_path, timeout=60)
    finally:
        served.close()
    assert done.returncode == 5 and done.stdout.startswith("argv ['code', '5']"), done.stderr


def test_signals_the_launcher_ignores_the_run_ignores_and_an_interrupt_ends_it_by_sigint(server, tmp_path):
    """As across an exec: SIGINT ignored by the launcher (a background job) is ignored by the run, and a
    run that dies of an uncaught KeyboardInterrupt ends by SIGINT (-2), as a real Python does."""
    job = tmp_path / "int.py"
    job.write_text(
        "import os, signal, sys\n"
        "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise KeyboardInterrupt\n"
    )
    ignoring = subprocess.run(
        via(job, "quiet", server=server),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert (ignoring.returncode, ignoring.stdout) == (0, "True\n"), ignoring.stderr
    interrupted = subprocess.run(via(job, "raise", server=server), env=subprocess_env(), capture_output=True, text=True)
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr, interrupted.stderr
    plain = subprocess.run([sys.executable, str(job), "raise"], capture_output=True, text=True)
    assert plain.returncode == interrupted.returncode  # what a launcher sees of a real Python


def test_a_client_gone_before_its_request_is_whole_leaves_the_server_serving(server, tmp_path):
    import socket

    for send in (False, True):  # gone before sending, and gone after sending (its pid no longer there)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(str(server.socket))
            if send:
                gone = subprocess.run(
                    [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
                )
                job = {"argv": ["x"], "env": {}, "cwd": "/", "client": int(gone.stdout)}
                socket.send_fds(conn, [json.dumps(job).encode()], [0, 1, 2])
    done = subprocess.run(
        via(_job(tmp_path), "code", "6", server=server), env=subprocess_env(), input="", capture_output=True, text=True
    )
    assert done.returncode == 6, done.stderr


RANK = textwrap.dedent(
    """
    import os, sys
    if __name__ == "__main__":
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
        sys.exit(int(sys.argv[1]))
    """
)


def test_a_launcher_of_a_served_script_forks_from_the_server_and_so_do_its_ranks(tmp_path):
    """``python -m torch.distributed.run ... SCRIPT`` through ``tests.helpers.run``: torchrun itself forks
    from SCRIPT's server (run as ``-m`` runs it) and starts its rank through forkexec; the rank's exit code
    reaches torchrun's summary, torchrun's own exit code the test."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with behind(script, preload=("json",)) as server:
        done = run(torchrun(1, script, "3"), cwd=tmp_path)
        assert (len(server._pids), len(server._served)) == (1, 1), (server._pids, server._served)
    assert done.returncode == 1 and "rank 0 of 1" in done.stdout, done.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*3\b", done.stderr), done.stderr[-3000:]
