"""``python tests/forkexec.py --socket=PATH SCRIPT ARGS...``: ``python SCRIPT ARGS`` forked from a test's fork server.

For a job whose launcher is under test (``spotguard rehearse``, ``spotguard run``, torchrun, ``accelerate
launch``): the launcher starts this small process (no torch), which asks the server listening at PATH
(``tests.forked.behind``; ``launched`` writes the command) to fork the run with this process's
environment, folder and standard streams, then stands in for it: the signals it gets go to the run (those
it ignores, the run ignores too), it exits as the run exits (the same code, or the same signal), and the
server kills the run if this process is killed. Without ``--socket`` it becomes ``python SCRIPT ARGS``
itself (exec). Standard library only: it imports nothing of the checkout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    if not argv or not argv[0].startswith("--socket="):
        os.execv(sys.executable, [sys.executable, *argv])
    path, argv = argv[0].partition("=")[2], argv[1:]
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

    ignored = [sig for sig in FORWARD if signal.getsignal(sig) == signal.SIG_IGN]
    for sig in set(FORWARD) - set(ignored):
        signal.signal(sig, forward)
    job = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid(), "ignored": ignored}
    fds = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    done: dict = {}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(job).encode()], fds)
            reply = json.loads(conn.recv(1 << 16) or b"{}")
            if "pid" in reply:
                child.append(reply["pid"])
                for sig in pending:
                    forward(sig, None)
                done = json.loads(conn.recv(1 << 16) or b"{}")
    except OSError as e:
        done = {"error": str(e)}
    if "code" not in done:
        if child:  # the server is gone: so is the run, or it would train on unwatched
            try:
                os.killpg(child[0], signal.SIGKILL)
            except OSError:
                pass
        print(f"forkexec: the fork server at {path} did not see {argv} through: {done}", file=sys.stderr)
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
