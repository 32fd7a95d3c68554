"""What killed writes left in a local storage root, and removing it (``spotguard rm --incomplete``).

Only spotguard's own names are reported, matched exactly (``TEMP_NAME``, ``SCRATCH_NAME``): a file
of a checkpoint that merely looks like one (``data.tmp-1``) is a checkpoint's file, never a leftover.
Links are never followed: a ``step-N`` that is a link is not a checkpoint folder of this root.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError, StorageError
from .base import LOCAL_TEMP_NAME, STEP_DIR, Leftover


class Rooted(Protocol):
    """What the housekeeping needs of ``LocalStorage`` (typed here, so this module never imports it back)."""

    @property
    def root(self) -> Path: ...

    def describe(self, key: str = "") -> str: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def failed(self, message: str, e: OSError) -> StorageError: ...


#: The exact names local storage writes while a write is in flight (``LocalStorage._tmp_path`` and
#: ``scratch``): ``NAME.tmp-HOST@PID-XXXXXXXX`` beside a target (``base.reserved_name``),
#: ``.spotguard.tmp-HOST@PID-XXXXXXXX/`` at the root.
TEMP_NAME = LOCAL_TEMP_NAME
SCRATCH_NAME = re.compile(r"\.spotguard\.tmp-(?:(?P<owner>[^/@]+@[0-9]+)-)?[a-z0-9_]{8}")


SCRATCH_PREFIX = ".spotguard.tmp-"
LEFTOVER_GRACE_S = 60.0  # a leftover unchanged this long has no live writer


def host() -> str:
    return socket.gethostname().replace("@", "_")


def _idle(path: Path) -> bool:
    """Unchanged for LEFTOVER_GRACE_S: the path and, for a directory, its entries."""
    try:
        paths = [path, *path.iterdir()] if path.is_dir() else [path]
        newest = max(p.stat().st_mtime for p in paths)
    except OSError:
        return False
    return time.time() - newest > LEFTOVER_GRACE_S


def _dead_owner(tagged: str) -> bool:
    """True for a leftover tagged ``host@pid-...`` (``LocalStorage``'s owner tag) whose process on this host is gone."""
    name, _, rest = tagged.rpartition("@")
    pid = _local_pid(f"{name}@{rest.split('-', 1)[0]}")
    return pid is not None and not _alive(pid)


def sweep(root: Path) -> None:
    """Remove what killed writers on this host left: scratch directories, temp files, empty step dirs.

    A save killed with SIGKILL cannot clean up after itself; without this, a job preempted
    again and again would leave one partial state file per kill. Only spotguard's own names
    are touched, and only when their writer's process on this host is gone and they have not
    changed for a while (a writer in another PID namespace on the same host looks dead, but a
    live one keeps writing). Other hosts' leftovers (a shared mount) are left alone.
    """
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(SCRATCH_PREFIX) and entry.is_dir(follow_symlinks=False):
            if _dead_owner(entry.name[len(SCRATCH_PREFIX) :]) and _idle(Path(entry.path)):
                shutil.rmtree(entry.path, ignore_errors=True)
        elif STEP_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            _sweep_dir(Path(entry.path))


def _sweep_dir(top: Path) -> None:
    """Bottom-up through one ``step-N/`` (sharded checkpoints nest ``shards/``)."""
    for dirpath, _, names in os.walk(top, topdown=False):
        path = Path(dirpath)
        for name in names:
            temp = TEMP_NAME.fullmatch(name)
            if temp and _dead_owner(temp["owner"]) and _idle(path / name):
                (path / name).unlink(missing_ok=True)
        if _idle(path):
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty: a checkpoint's directory never is


def find(storage: Rooted) -> list[Leftover]:
    """Scratch folders at the root, temp files in ``step-N/`` folders (and of the root's own
    ``spotguard-*`` files), ``step-N/`` folders holding no file: nothing else is looked at."""
    try:
        entries = list(os.scandir(storage.root))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise storage.failed(f"cannot list {storage.describe()}: {e}", e) from e
    found = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            scratch = SCRATCH_NAME.fullmatch(entry.name)
            stats = tree_stats(Path(entry.path)) if scratch else None
            if scratch and stats:
                found.append(Leftover(entry.name + "/", "scratch folder", *stats, owner=scratch["owner"] or ""))
            elif STEP_DIR.fullmatch(entry.name):
                found += _step_leftovers(storage.root, Path(entry.path))
        elif entry.name.startswith("spotguard") and entry.is_file(follow_symlinks=False):
            found += _temp_file(storage.root, Path(entry.path))
    return found


def _step_leftovers(root: Path, top: Path) -> list[Leftover]:
    found, files = [], 0
    for dirpath, _, names in os.walk(top):  # never follows symlinks
        files += len(names)
        for name in names:
            found += _temp_file(root, Path(dirpath) / name)
    stats = None if files else tree_stats(top)
    if stats:
        found.append(Leftover(top.name + "/", "empty folder", 0, stats[1]))
    return found


def _temp_file(root: Path, path: Path) -> list[Leftover]:
    """``path`` as a Leftover when it is one of ``_tmp_path``'s names."""
    m = TEMP_NAME.fullmatch(path.name)
    if not m:
        return []
    try:
        st = path.lstat()
    except FileNotFoundError:
        return []
    if not stat.S_ISREG(st.st_mode):
        return []
    rel = path.relative_to(root).as_posix()
    return [Leftover(rel, "temp file", st.st_size, st.st_mtime, owner=m["owner"])]


def remove(storage: Rooted, item: Leftover) -> None:
    """Delete one leftover ``find`` reported, checking its name and kind again."""
    path = storage.root / item.key.rstrip("/")
    top = path.parent == storage.root and not path.is_symlink()
    try:
        if item.kind == "scratch folder" and SCRATCH_NAME.fullmatch(path.name) and top:
            if path.is_dir():
                shutil.rmtree(path)
        elif item.kind == "temp file" and TEMP_NAME.fullmatch(path.name):
            storage.delete([item.key])  # and the folders it leaves empty
        elif item.kind == "empty folder" and STEP_DIR.fullmatch(path.name) and top:
            for dirpath, _, _ in os.walk(path, topdown=False):
                os.rmdir(dirpath)  # fails, and stops, if a file appeared meanwhile
        else:
            raise ConfigError(f"{storage.describe(item.key)} is not a leftover of local storage")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise storage.failed(f"cannot delete {storage.describe(item.key)}: {e}", e) from e


def tree_stats(top: Path) -> tuple[int, float] | None:
    """Bytes held below ``top`` and its newest change (``top`` and every entry, links not followed);
    None when ``top`` is gone (an age unknown must never read as old)."""
    try:
        newest = top.lstat().st_mtime
    except OSError:
        return None
    size = 0
    for dirpath, dirs, names in os.walk(top):
        for name in dirs + names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, newest


def writer_running(owner: str) -> bool:
    """Whether ``owner`` ("host@pid", from a Leftover) is a process running on this host."""
    pid = _local_pid(owner)
    return pid is not None and _alive(pid)


def _local_pid(owner: str) -> int | None:
    """The pid of ``owner`` ("host@pid") when it names a process of this host; None for another host's."""
    name, _, pid = owner.rpartition("@")
    return int(pid) if name == host() and pid.isascii() and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True
