"""DeepSpeed's op for CPU jobs, built once per session by a process no test kills.

Every DeepSpeed job on the CPU loads its shared-memory all-reduce op (``ShareMemCommBuilder``) with
torch's JIT builder, under a lock file in ``$TORCH_EXTENSIONS_DIR``: the first job builds it (minutes
on 2 busy cores), each later one checks it under the same lock. A job killed while it holds the lock
(a test stops jobs at will) leaves the file behind, and every DeepSpeed job after it waits for it
forever: in one CI run of 2026-11-28 a test sat 240 s before its first step. Two checkouts sharing
the default folder (``~/.cache``) also rebuilt the op in turn, each for its own torch.

So the controller points the folder at this checkout's venv and removes a lock an earlier session
left (``spotguard run``'s own clean-up before a restart); the first test process whose tests run
DeepSpeed jobs (slow tests with DeepSpeed in their name) builds the op in a process of its own, and
the jobs then only check it. That process is stopped (the lock released) and reaped at the end of
the test process that started it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

FOLDER = Path(sys.prefix) / "torch_extensions"
_BUILD = """
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # unwinds: torch's lock is released in a finally
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
"""
_proc: list[subprocess.Popen[bytes]] = []
_held: list[IO[str]] = []  # the flock that makes one test process of a session the builder


def prepare() -> None:
    """Before the workers start: this checkout's folder, without a lock an earlier session left."""
    from spotguard.ops.supervisor import buildlocks  # here: the workers' imports stay the tests' own

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(FOLDER))
    buildlocks.clear_stale(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


def build_if_used(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the build when this process's tests run DeepSpeed jobs and no other test process builds it
    (each xdist worker collects every test: the first to get here builds)."""
    if _proc or config.option.collectonly:
        return
    if not any(i.get_closest_marker("slow") and "deepspeed" in i.nodeid.lower() for i in items):
        return
    if importlib.util.find_spec("deepspeed") is None:
        return
    try:
        folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR", FOLDER))
        folder.mkdir(parents=True, exist_ok=True)
        held = open(folder / ".spotguard-tests-build", "w")  # noqa: SIM115 - held until stop()
    except OSError:
        return  # a folder it cannot write: the jobs build it, as without this module
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.close()  # another test process builds it
        return
    _held.append(held)
    _proc.append(
        subprocess.Popen(
            [sys.executable, "-c", _BUILD],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )


def stop() -> None:
    """At the session's end: a build still running is stopped and reaped, with its compilers."""
    for proc in _proc:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            with contextlib.suppress(OSError):  # its group (the compilers) while its pid is still its own
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _proc.clear()
    for held in _held:
        held.close()
    _held.clear()
