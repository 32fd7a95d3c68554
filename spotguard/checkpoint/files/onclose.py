"""Hashes of a trainer's checkpoint files, taken while the trainer is still writing the next ones.

A trainer's save (``engine.save_checkpoint``, ``Trainer._save_checkpoint``, ``accelerator.save_state``)
writes its folder file by file; spotguard then hashes every file for the manifest before it commits.
On an emergency that hashing sits on the deadline's clock after the trainer's own save. Here a thread
hashes each file as soon as its writer closes it (Linux inotify's ``IN_CLOSE_WRITE``), so by the
commit only the files closed last are left to hash: ``store_files`` asks ``known(path, alg)`` first.
For a local storage, which stores the file itself (a hard link), each file is also synced then.

A hash is only handed out for bytes nothing has touched since: any later write, truncation, rename
or deletion of the file (``IN_MODIFY`` and friends, read from the queue before each answer), an
event queue that overflowed, or another size, inode or modification time than when it was hashed,
and the file is hashed again at the commit as before. Files written
through a shared memory map raise no inotify event; their modification time still changes. Without
inotify (not Linux), nothing is hashed early: ``known`` answers None.

Files are read, never mapped, while the trainer writes on: another rank writing a file of the same
name truncates it, and a page of a map cut off that way kills the reader (SIGBUS). Our own files in
a trainer's folder are written through ``replace_text``, which never truncates one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import secrets
import select
import struct
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path

from spotguard.checkpoint.format import digest

logger = logging.getLogger(__name__)

IN_MODIFY, IN_CLOSE_WRITE = 0x2, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_ISDIR = 0x400, 0x800, 0x4000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
#: Events that make a hash taken before them stale (IN_CLOSE_WRITE also starts a new one). Not IN_ATTRIB:
#: the commit's own hard link changes the link count (and the ctime), not a byte.
CHANGED = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE
WATCH = CHANGED | IN_CREATE | IN_DELETE_SELF | IN_MOVE_SELF
_EVENT = struct.Struct("iIII")
POLL_S = 0.01


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc if hasattr(libc, "inotify_init1") else None
    except OSError:
        return None


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` (and its folder) as a new file put in place by a rename: a reader of the old one
    (another rank's commit, a hasher) keeps reading whole bytes, where a rewrite would truncate them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")  # writers on other nodes: other names
    tmp.write_text(text)
    os.replace(tmp, path)


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


class ClosedFileHashes:
    """``with ClosedFileHashes(folder) as hashes:`` the trainer's save into ``folder``, then the commit with
    ``known=hashes.known``; leaving the block stops the threads. ``folder`` (which must exist) and the
    folders created in it are watched. ``sync``: also fsync each file once hashed (for a storage that
    keeps the file itself, ``Storage.links_files``)."""

    def __init__(self, folder: Path, alg: str | None = None, sync: bool = False) -> None:
        self.alg = alg or digest.default_alg()
        self.sync = sync
        self._lock = threading.Lock()
        self._hashes: dict[Path, Future[tuple[tuple[int, int, int], str] | None]] = {}
        self._dirs: dict[int, Path] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="spotguard-onclose")
        self._fd = -1
        self._reader: threading.Thread | None = None
        libc = _libc()
        if libc is not None:
            self._libc = libc
            self._fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if self._fd < 0 or not self._watch(Path(folder)):
                logger.debug("inotify unusable: files are hashed at the commit")
                self.close()
                return
            self._wake_r, self._wake_w = os.pipe()
            self._reader = threading.Thread(target=self._read, name="spotguard-onclose-events", daemon=True)
            self._reader.start()

    def __enter__(self) -> ClosedFileHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        """The events as they come: a hash starts when its file closes, not when the commit asks."""
        while True:
            ready = select.select([self._fd, self._wake_r], [], [])[0]
            if self._wake_r in ready:
                return
            self.drain()
            # A pause between reads lets the kernel merge a writer's run of IN_MODIFY into one event
            # (a large save is many writes): ~100 wake-ups a second at most, a hash starts <= 10 ms late.
            if select.select([self._wake_r], [], [], POLL_S)[0]:
                return

    def _watch(self, folder: Path) -> bool:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), WATCH)
        if wd < 0:
            return False
        self._dirs[wd] = folder
        return True

    def drain(self) -> None:
        """Read every queued event: each change seen before an answer is taken into account."""
        with self._lock:
            while self._fd >= 0 and select.select([self._fd], [], [], 0)[0]:
                try:
                    buf = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    break
                self._handle(buf)

    def _handle(self, buf: bytes) -> None:
        at = 0
        while at + _EVENT.size <= len(buf):
            wd, mask, _, n = _EVENT.unpack_from(buf, at)
            name = buf[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0")
            at += _EVENT.size + n
            if mask & IN_Q_OVERFLOW:  # events were lost: nothing known is trusted
                self._hashes.clear()
                continue
            folder = self._dirs.get(wd)
            if folder is None:
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                self._hashes = {p: f for p, f in self._hashes.items() if folder not in p.parents}
                continue
            path = folder / os.fsdecode(name)
            if mask & IN_ISDIR:
                if mask & IN_CREATE:
                    self._watch(path)  # a file closed in it before the watch is simply hashed at the commit
                continue
            if mask & CHANGED:
                self._hashes.pop(path, None)
            if mask & IN_CLOSE_WRITE:
                self._hashes[path] = self._pool.submit(self._hash, path)

    def _hash(self, path: Path) -> tuple[tuple[int, int, int], str] | None:
        try:
            before = _key(path.stat())
            value = digest.read_file_digest(path, digest.CHUNK, alg=self.alg)  # the trainer may rewrite it
            if self.sync:  # its bytes on the disk while the trainer writes on: the store's fsync finds them there
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return (before, value) if _key(path.stat()) == before else None
        except Exception:  # gone, cut short, unreadable: an early hash is only a head start; the commit
            return None  # hashes the file itself (and reports what is wrong with it)

    def known(self, path: Path, alg: str) -> str | None:
        """The digest of ``path`` with ``alg`` when it was hashed after its last write; else None (also
        once closed: no change is seen any more)."""
        self.drain()
        with self._lock:
            fut = self._hashes.get(Path(path)) if self._fd >= 0 else None
        if fut is None or alg != self.alg:
            return None
        try:
            got = fut.result()  # hashing already, on the thread: waiting is never slower than starting over
        except CancelledError:
            return None
        if got is None:
            return None
        self.drain()  # a write during the hash
        with self._lock:
            if self._hashes.get(Path(path)) is not fut:
                return None
        try:
            return got[1] if _key(Path(path).stat()) == got[0] else None
        except OSError:
            return None

    def close(self) -> None:
        """Stop watching and let the hashing thread go (idempotent)."""
        if self._reader is not None:
            os.write(self._wake_w, b"x")
            self._reader.join()
            self._reader = None
            os.close(self._wake_r)
            os.close(self._wake_w)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self._pool.shutdown(wait=True, cancel_futures=True)  # at most the file being hashed
