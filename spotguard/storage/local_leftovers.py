"""What killed writes left in a local storage root, and removing it (``spotguard rm --incomplete``).

Only spotguard's own names are reported, matched exactly (``TEMP_NAME``, ``SCRATCH_NAME``): a file
of a checkpoint that merely looks like one (``data.tmp-1``) is a checkpoint's file, never a leftover.
Links are never followed: a ``step-N`` that is a link is not a checkpoint folder of this root.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import STEP_DIR, Leftover

if TYPE_CHECKING:
    from .local import LocalStorage

#: The exact names local storage writes while a write is in flight (``LocalStorage._tmp_path`` and
#: ``scratch``): ``NAME.tmp-HOST@PID-XXXXXXXX`` beside a target, ``.spotguard.tmp-HOST@PID-XXXXXXXX/``
#: at the root. Checkpoint file names cannot contain ``@``, so no checkpoint file matches the first.
TEMP_NAME = re.compile(r".+\.tmp-(?P<owner>[^/@]+@[0-9]+)-[0-9a-f]{8}")
SCRATCH_NAME = re.compile(r"\.spotguard\.tmp-(?:(?P<owner>[^/@]+@[0-9]+)-)?[a-z0-9_]{8}")


def host() -> str:
    return socket.gethostname().replace("@", "_")


def find(storage: LocalStorage) -> list[Leftover]:
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


def remove(storage: LocalStorage, item: Leftover) -> None:
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
    name, _, pid = owner.rpartition("@")
    if name != host() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True
