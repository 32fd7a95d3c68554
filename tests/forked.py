"""Runs of worker scripts and examples for the price of one ``import torch``: forked from one server.

A test that runs a script several times (a reference, a stopped run, its resume) pays a Python start
and ``import torch`` (spotguard, torchdata, a trainer library: 3-5 CPU seconds each on the 2-core
machine) for every run. Where the start itself is not under test, a ``ForkServer``
(``python -m tests.forked``) imports the scripts' heavy modules once, runs no torch op, and forks one
child per run: the child takes its environment, folder, argv and output files, becomes the leader of a
session of its own (as ``start_new_session``), runs the script as ``__main__`` and exits through
interpreter shutdown like any process: its exit status, signals, handlers and atexit work as in a
process of its own. Each child starts from the server's imports only (nothing of them was run: no
thread started, no handler installed) and draws fresh seeds for torch and numpy, as a new process does.
Environment variables read when a module is imported keep the server's values: spotguard reads none then.

``ForkServer.popen`` gives a ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``,
``send_signal``), which ``tests.helpers.run`` and ``stop_when`` use while a server is ``installed``
for a script's runs, and for a launcher of it (``python -m torch.distributed.run ... SCRIPT``, run as
``-m`` runs it): a launcher's start is not what those tests are about; tests of a launcher's start and
death (tests/ops/test_launchers.py) start it from ``spotguard run``, as a process of its own. tests/workers/dist_teardown.py's ``--fork-chain`` does the same for the ranks of
a process group.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

#: ``[sys.executable, FORKEXEC, "--socket=PATH", SCRIPT, *args]`` runs ``SCRIPT`` forked from a ``behind``
#: server (``launched`` and ``via`` write it).
FORKEXEC = Path(__file__).with_name("forkexec.py")
SOCKET_ENV = "TESTS_FORKSERVER_SOCKET"  # where a listening server (``behind``) is told to listen

#: Imported by the server before it forks: what the workers and examples import (torch first), and
#: torch._dynamo with sympy, which an optimizer's constructor imports (1-2.5 CPU-s a run on this machine).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torchdata.stateful_dataloader",
    "spotguard",
    "spotguard.guard",
)


class Forked:
    """A run forked by a ``ForkServer``: what ``subprocess.Popen`` offers the tests' helpers."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            if not self._server.alive():
                raise RuntimeError(f"the fork server ended before run {self.pid}: {self._server.log()}")
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """``python -m tests.forked PRELOAD...``: forks the runs it is sent (several may run at once)."""

    def __init__(self, *preload: str | Path, env: dict[str, str] | None = None, listen: bool = False) -> None:
        """``listen``: also fork the runs ``forkexec`` clients ask for, at ``self.socket``."""
        from tests.helpers import REPO, WAIT_S, subprocess_env

        self._log = tempfile.NamedTemporaryFile(prefix="forkserver-", suffix=".log")  # noqa: SIM115
        self._dir = tempfile.TemporaryDirectory(prefix="forkserver-")
        #: Where ``forkexec`` clients reach this server (``listen``), else None.
        self.socket = os.path.join(self._dir.name, "socket") if listen else None
        own = {SOCKET_ENV: self.socket} if self.socket else {}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forked", *(str(p) for p in preload or PRELOAD)],
            env={**{k: v for k, v in (env or subprocess_env()).items() if k != SOCKET_ENV}, **own},
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        self._codes: dict[int, int] = {}
        self._pids: list[int] = []
        self._served: list[int] = []
        self._ready = self._ended = False
        self._lock = threading.Lock()
        self._started = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        with self._started:  # the imports done
            self._started.wait_for(lambda: self._ready or self._ended, WAIT_S)
        assert self._ready and self.alive(), f"the fork server did not start: {self.log()}"

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._started:
                if "code" in msg:
                    self._codes[msg["pid"]] = msg["code"]
                elif "served" in msg:  # a forkexec client's run
                    self._served.append(msg["served"])
                elif "pid" in msg:
                    self._pids.append(msg["pid"])
                else:
                    self._ready = True
                self._started.notify_all()
        with self._started:  # the server's end (its pipe's, which can come before its exit status)
            self._ended = True
            self._started.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-3000:]

    def popen(self, cmd: list[str], *, env: dict[str, str], cwd: Path | None, out: str, err: str) -> Forked:
        """Start ``cmd`` (``[python, SCRIPT, *args]``), its output to the files ``out`` and ``err``."""
        job = {"argv": [str(a) for a in cmd[1:]], "env": env, "cwd": str(cwd or Path.cwd()), "out": out, "err": err}
        with self._lock, self._started:
            known = len(self._pids)
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            self._started.wait_for(lambda: len(self._pids) > known or self._ended, 60)
            assert len(self._pids) > known, f"the fork server did not start {cmd}: {self.log()}"
            return Forked(self, self._pids[known], list(cmd))

    def close(self) -> None:
        for pid in [*self._pids, *self._served]:  # a run still alive (its test failed): its session goes first
            if pid not in self._codes:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the server ends once its runs are reaped
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._reader.join(5)
        self._log.close()
        self._dir.cleanup()


class _Lazy:
    """A server started at its first run (a module whose runs are all deselected or skipped starts none)."""

    def __init__(self, preload: tuple[str | Path, ...]) -> None:
        self.preload, self._lock = preload, threading.Lock()
        self.server: ForkServer | None = None

    def get(self) -> ForkServer:
        with self._lock:
            if self.server is None:
                self.server = ForkServer(*self.preload)
            return self.server


_installed: dict[str, _Lazy] = {}


#: Launchers run as ``python -m MODULE`` that fork from the server of the script they launch: their start
#: (a Python start and ``import torch``, 1.3-1.7 CPU-s each) is not what a test of their ranks is about.
LAUNCHERS = ("torch.distributed.run", "accelerate.commands.launch")


def server_for(cmd: list[str]) -> ForkServer | None:
    """The server installed for ``cmd``'s script (``[sys.executable, SCRIPT, ...]``), if any; for a launcher
    (``[sys.executable, "-m", LAUNCHER, ..., SCRIPT, ...]``) the server of the script it launches."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] == "-m":
        if len(cmd) < 3 or cmd[2] not in LAUNCHERS:
            return None
        lazy = next((_installed[k] for k in map(_key, cmd[3:]) if k in _installed), None)
    else:
        lazy = _installed.get(_key(cmd[1]))
    return lazy.get() if lazy else None


def _key(arg: str) -> str:
    return str(Path(arg).resolve()) if arg and not arg.startswith("-") else ""


@contextlib.contextmanager
def installed(*scripts: str | Path, preload: tuple[str | Path, ...] = ()) -> Iterator[None]:
    """While inside, ``tests.helpers.run`` and ``stop_when`` fork every ``[sys.executable, SCRIPT, ...]``
    of these scripts from one server (started at the first), which imported ``preload`` (module names,
    or scripts whose top level is run: their imports) and the scripts' own imports."""
    lazy = _Lazy((*(preload or PRELOAD), *scripts))
    try:
        with _registered(scripts, lazy):
            yield
    finally:
        if lazy.server is not None:
            lazy.server.close()


@contextlib.contextmanager
def _registered(scripts: tuple[str | Path, ...], lazy: _Lazy) -> Iterator[None]:
    """While inside, the runs of ``scripts`` fork from ``lazy``'s server (``server_for``)."""
    keys = [str(Path(s).resolve()) for s in scripts]
    _installed.update(dict.fromkeys(keys, lazy))
    try:
        yield
    finally:
        for key in keys:
            _installed.pop(key, None)


class Served:
    """One server for scripts written as the tests go (a snippet per test, each in its own folder):
    ``with served.scripts(path):`` forks that script's runs from it. The server starts at the first
    run and imports ``preload`` only: unlike ``installed``, no script's top level is run there (a
    snippet has no ``__main__`` guard: its top level is the whole run). ``close()`` at the end."""

    def __init__(self, preload: tuple[str | Path, ...] = ()) -> None:
        self._lazy = _Lazy(preload or PRELOAD)

    def scripts(self, *scripts: str | Path) -> contextlib.AbstractContextManager[None]:
        return _registered(scripts, self._lazy)

    def close(self) -> None:
        if self._lazy.server is not None:
            self._lazy.server.close()


def run_forked(
    runs: list[list[str]], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run each ``[script, *args]`` of ``runs`` to its end, one after another, each forked from one
    server; a run's failure is its exit status, as ``tests.helpers.run`` gives."""
    from tests.helpers import run

    with installed(*{r[0] for r in runs}):
        return [run([sys.executable, *map(str, r)], env=env, cwd=cwd) for r in runs]


@contextlib.contextmanager
def behind(*scripts: str | Path, preload: tuple[str | Path, ...] = ()) -> Iterator[ForkServer]:
    """A server for jobs a launcher under test starts (rehearse, the supervisor, torchrun): while inside,
    a launcher that starts ``[sys.executable, *launched(SCRIPT), ...]`` gets each job forked from this
    server, which imported ``preload`` and the scripts' imports once. The launcher's own start, signals
    and exit handling are what they would be. The scripts' own runs (``tests.helpers.run``) fork from it
    too, as under ``installed``."""
    lazy = _Lazy(())
    lazy.server = server = ForkServer(*(preload or PRELOAD), *scripts, listen=True)
    try:
        with _registered(scripts, lazy):
            yield server
    finally:
        server.close()


def launched(script: str | Path) -> list[str]:
    """How a launcher (torchrun) is to start ``script``: through ``FORKEXEC`` from the ``behind`` server
    that imported it, while one runs, else as it is."""
    lazy = _installed.get(str(Path(script).resolve()))
    server = lazy.server if lazy else None
    return [str(FORKEXEC), f"--socket={server.socket}", str(script)] if server and server.socket else [str(script)]


def via(script: str | Path, *args: str | Path, server: ForkServer | None = None) -> list[str]:
    """``[python, FORKEXEC, ...]``: ``script`` forked from ``server`` (``behind``), or plainly without one."""
    named = [f"--socket={server.socket}"] if server else []
    return [sys.executable, str(FORKEXEC), *named, str(script), *map(str, args)]


# -- the server ---------------------------------------------------------------------------------------
def _child(job: dict, fds: list[int] | None = None) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` (or ``-m LAUNCHER``) in a session of its own; never returns.
    ``fds``: the standard streams a ``forkexec`` client sent (else ``/dev/null`` and the job's files)."""
    os.setsid()
    # The test sees the server's pipe end when the server ends, not a child; the listener, the clients'
    # connections and pidfds are the server's. Closed through their objects: a number closed under an
    # object would be closed again, whatever it then is, when the object goes.
    for held in [_PROTOCOL[0], *_SERVER_HELD]:
        held.close() if hasattr(held, "close") else os.close(held)
    if fds is not None:
        for fd, f in enumerate(fds):
            os.dup2(f, fd)
            os.close(f)
    else:
        for fd, path in ((0, os.devnull), (1, job["out"]), (2, job["err"])):
            f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(f, fd)
            os.close(f)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(job["env"])
    tempfile.tempdir = None  # $TMPDIR is read again, from the run's environment
    for sig in job.get("ignored", ()):  # what its launcher ignores, the run ignores, as across an exec
        signal.signal(sig, signal.SIG_IGN)
    os.chdir(job["cwd"])
    module = job["argv"][1] if job["argv"][0] == "-m" else None  # `python -m MODULE ARGS` (a launcher)
    script = os.path.abspath(job["argv"][0])
    sys.argv = [script, *job["argv"][1:]] if module is None else ["-m", *job["argv"][2:]]
    sys.path[0] = os.path.dirname(script) if module is None else os.getcwd()  # as `python SCRIPT` / `-m` set it
    if "torch" in sys.modules:  # a process of its own draws fresh seeds (`random` reseeds itself after a fork)
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        if module is None:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)  # sets sys.argv[0] as `-m` does
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Python ends such a process by SIGINT, after its exit handlers
        import atexit
        import traceback

        traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)  # interpreter shutdown (atexit, finalizers), as the script's own process would


_PROTOCOL: list = []  # the pipe to the test (the server's first stdout); its own output goes to stderr


def _say(msg: dict) -> None:
    _PROTOCOL[0].write(json.dumps(msg) + "\n")
    _PROTOCOL[0].flush()


_SERVER_HELD: list = []  # what a forked child closes first: sockets, and pidfds (numbers)


def _listen() -> socket.socket | None:
    """The socket ``forkexec`` clients connect to, when the test named one (``behind``)."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    _SERVER_HELD.append(listener)
    return listener


def _accepted(listener: socket.socket) -> tuple[socket.socket, dict, list[int], int] | None:
    """A ``forkexec`` client's job, its standard streams and a pidfd of the client; None, with all of
    it closed, when the client went away before its request was whole."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(5)  # a client stopped between its connect and its send must not stall the others
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        job = json.loads(msg)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} streams")
        pidfd = os.pidfd_open(job["client"])
        conn.settimeout(None)
        return conn, job, fds, pidfd
    except (OSError, ValueError, KeyError) as e:
        print(f"forkserver: a client's request dropped: {e!r}", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None


def serve(preload: list[str]) -> int:
    _PROTOCOL.append(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)  # what a preloaded script prints stays out of the protocol
    for name in preload:
        if name.endswith(".py"):  # a script: its top level (imports and definitions), not its main
            sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
            runpy.run_path(name, run_name="__forkserver_preload__")
            sys.path.pop(0)
        else:
            importlib.import_module(name)
    listener = _listen()
    _say({"ready": True})
    running: set[int] = set()
    clients: dict[int, socket.socket] = {}  # a forkexec client's run -> its connection
    watched: dict[int, int] = {}  # a client's pidfd -> its run, killed if the client dies first
    stdin_open = True

    def fork(job: dict, fds: list[int] | None = None) -> int:
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job, fds)  # exits
        running.add(pid)
        return pid

    while stdin_open or running:
        inputs = [*watched, *([sys.stdin] if stdin_open else []), *([listener] if listener and stdin_open else [])]
        for ready in select.select(inputs, [], [], 0.01)[0]:
            if ready is sys.stdin:
                line = sys.stdin.readline()
                if not line:
                    stdin_open = False
                else:
                    _say({"pid": fork(json.loads(line))})
            elif ready is listener:
                accepted = _accepted(listener)
                if accepted is None:
                    continue
                conn, job, fds, pidfd = accepted
                _SERVER_HELD.extend((conn, pidfd))
                pid = fork(job, fds)
                for fd in fds:
                    os.close(fd)
                clients[pid], watched[pidfd] = conn, pid
                _say({"served": pid})
                with contextlib.suppress(OSError):  # a client gone already: its pidfd is readable, its run killed
                    conn.send(json.dumps({"pid": pid}).encode())
            else:  # a client ended while its run goes on: its launcher killed it, so the run goes too
                pid = watched.pop(ready)
                os.close(ready)
                _SERVER_HELD.remove(ready)
                if pid in running:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                _say({"pid": pid, "code": code})
                conn = clients.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.send(json.dumps({"code": code}).encode())
                    _SERVER_HELD.remove(conn)
                    conn.close()
    for pidfd in watched:
        os.close(pidfd)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
