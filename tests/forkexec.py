"""``python tests/forkexec.py SCRIPT ARGS...``: ``python SCRIPT ARGS`` forked from the tests' fork server.

For a job whose launcher is under test (``spotguard rehearse``, ``spotguard run``, torchrun, ``accelerate
launch``): the launcher starts this small process (no torch), which asks the server named by
``$TESTS_FORKSERVER_SOCKET`` (``tests.forked.behind``) to fork the run with this process's environment,
folder and standard streams, then stands in for it: the signals it gets go to the run, it exits as the run
exits (the same code, or the same signal), and the server kills the run if this process is killed. Without
the variable it becomes ``python SCRIPT ARGS`` itself (exec). Standard library only: it imports nothing of
the checkout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "TESTS_FORKSERVER_SOCKET"
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        os.execv(sys.executable, [sys.executable, *argv])
    child: list[int] = []
    pending: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        if child:
            try:
                os.kill(child[0], sig)
            except ProcessLookupError:
                pass
        else:
            pending.append(sig)  # arrived before the run had a pid: sent once it has

    for sig in FORWARD:
        signal.signal(sig, forward)
    job = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid()}
    fds = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(job).encode()], fds)
        reply = json.loads(conn.recv(1 << 16) or b"{}")
        if "pid" not in reply:
            print(f"forkexec: the fork server did not start {argv}: {reply}", file=sys.stderr)
            return 1
        child.append(reply["pid"])
        for sig in pending:
            forward(sig, None)
        done = json.loads(conn.recv(1 << 16) or b"{}")
    if "code" not in done:
        print(f"forkexec: the fork server ended before run {child[0]} did", file=sys.stderr)
        return 1
    code = done["code"]
    if code < 0:  # ended by a signal: end by the same one, so the launcher sees what it would have seen
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
