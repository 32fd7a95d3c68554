"""DeepSpeed's op for CPU jobs, built once per session by a process no test kills.

Every DeepSpeed job on the CPU loads its shared-memory all-reduce op (``ShareMemCommBuilder``) with
torch's JIT builder, under a lock file in ``$TORCH_EXTENSIONS_DIR``: the first job builds it (minutes
on 2 busy cores), each later one checks it under the same lock. A job killed while it holds the lock
(a test stops jobs at will) leaves the file behind, and every DeepSpeed job after it waits for it
forever: in one CI run of 2026-11-28 a test sat 240 s before its first step. Two checkouts sharing
the default folder (``~/.cache``) also rebuilt the op in turn, each for its own torch.

So the controller points the folder at this checkout's venv, removes a lock an earlier session left,
and, once the collected tests include DeepSpeed ones, builds the op in a process of its own; the
jobs then only check it. That process is stopped (the lock released) and reaped at the session's end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

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


def prepare() -> None:
    """Before the workers start: this checkout's folder, without a lock an earlier session left."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(FOLDER))
    for lock in Path(os.environ["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):
        lock.unlink(missing_ok=True)


def build_if_used(test_ids: list[str]) -> None:
    """Start the build when a collected test runs DeepSpeed (once a session)."""
    if _proc or not any("deepspeed" in t.lower() for t in test_ids):
        return
    if importlib.util.find_spec("deepspeed") is None:
        return
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
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _proc.clear()
