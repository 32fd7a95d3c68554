"""The job's processes: everything a launcher started, found again once the launcher is gone.

Launchers put their ranks out of reach of one process group: torchrun (and ``accelerate launch``
with several processes, which runs it) starts every rank in a session of its own, and
``accelerate launch`` in one process or ``deepspeed`` on one node die of a SIGTERM at once,
leaving their trainer running. So one attempt's processes are two sets, merged: the process group
``spotguard run`` started the command in, and every process whose environment holds this attempt's
``$SPOTGUARD_HEARTBEAT`` (each child inherits it; read from ``/proc``, so on Linux only, the group
alone elsewhere). The topmost of them, those whose parent is not in the job, are where a stop
signal goes: the launcher while it runs, then what it left behind. Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from spotguard import heartbeat

PROC = Path("/proc")


class Job:
    """One attempt's processes: the launcher (``proc``, leader of its own group) and all it started."""

    def __init__(self, proc: subprocess.Popen[bytes], beat: Path) -> None:
        self.proc = proc
        self._marker = f"{heartbeat.HEARTBEAT_ENV}={beat}".encode() + b"\0"
        self._seen: dict[tuple[int, bytes], bool] = {}  # (pid, start time) -> carries the marker
        self._sent: set[tuple[int, int]] = set()  # (pid, signal) we delivered

    # -- finding them ------------------------------------------------------------------------
    def processes(self) -> dict[int, int]:
        """pid -> parent pid of every live process of the job (the launcher included while it runs)."""
        if not PROC.is_dir():  # no /proc: the process group stands for the job, its leader's pid for all
            return {self.proc.pid: 0} if _group_alive(self.proc.pid) else {}
        found: dict[int, int] = {}
        me = os.getpid()
        for name in os.listdir(PROC):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            try:
                raw = (PROC / name / "stat").read_bytes()
            except OSError:
                continue  # gone meanwhile
            fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) ": the name may hold anything
            state, ppid, pgrp, started = fields[0], int(fields[1]), int(fields[2]), fields[19]
            if state in (b"Z", b"X"):
                if me == 1 and ppid == me and pid != self.proc.pid:
                    _reap(pid)  # an orphan handed to us, PID 1 of a container: nobody else will
                continue
            if pgrp == self.proc.pid or self._marked(pid, started):
                found[pid] = ppid
        return found

    def _marked(self, pid: int, started: bytes) -> bool:
        key = (pid, started)  # the start time tells a reused pid apart
        if key not in self._seen:
            try:
                environ = b"\0" + (PROC / str(pid) / "environ").read_bytes()  # NUL-separated NAME=value
                self._seen[key] = b"\0" + self._marker in environ
            except OSError:
                self._seen[key] = False  # another user's, or gone
        return self._seen[key]

    def leftovers(self) -> dict[int, int]:
        """The job's processes other than the launcher (all of them once it has exited)."""
        procs = self.processes()
        if self.proc.returncode is None:
            procs.pop(self.proc.pid, None)
        return procs

    def top(self) -> list[int]:
        """The topmost live processes: the launcher while it runs, else those whose parent left the job."""
        if self.proc.returncode is None:
            return [self.proc.pid]
        procs = self.processes()
        return sorted(pid for pid, ppid in procs.items() if ppid not in procs)

    # -- acting on them ----------------------------------------------------------------------
    def signal_top(self, sig: int, again: bool = False) -> list[int]:
        """Send ``sig`` to the topmost processes (launchers forward it to their ranks); the pids reached.

        A process that already had ``sig`` from us is skipped unless ``again``: to a Guard a second
        delivery means "stop now", so only a stop signal repeated on purpose may be one.
        """
        group = self.proc.returncode is not None and not PROC.is_dir()  # no /proc: the whole group
        reached = []
        for pid in self.top():
            if (pid, sig) in self._sent and not again:
                continue
            self._sent.add((pid, sig))
            try:
                os.killpg(pid, sig) if group else os.kill(pid, sig)
                reached.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        return reached

    def wait_gone(self, until: float, poll: float) -> bool:
        """Wait until no process of the job is left (True) or ``time.monotonic()`` passes ``until``."""
        while True:
            if self.proc.returncode is None:
                self.proc.poll()
            if self.proc.returncode is not None and not self.leftovers():
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(poll)

    def kill_all(self) -> None:
        """SIGKILL the launcher, its process group and every other process of the job."""
        targets = set(self.processes())
        if self.proc.returncode is None:
            targets.add(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def describe(self, pids: dict[int, int] | list[int]) -> str:
        """``1234 (python train.py ...), ...`` for the log."""
        return ", ".join(f"{pid} ({_cmdline(pid)})" for pid in pids)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _cmdline(pid: int, width: int = 80) -> str:
    try:
        args = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in args if a)
    return text if len(text) <= width else text[: width - 3] + "..."
