"""Local (or network-mounted) directory storage.

Atomicity comes from the POSIX recipe: write a temp file beside the target, fsync it, rename it
over the target (or hard-link it for write-once), then fsync the directory so the rename itself
survives a power cut. Temp files are named ``NAME.tmp-HOST@PID-XXXXXXXX`` and are invisible to ``list()``
(``local_leftovers.TEMP_NAME``, a name no checkpoint file can take).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from ..errors import CheckpointExistsError, ConfigError, PreconditionFailedError, StorageAccessError, StorageError
from . import local_leftovers
from .base import Leftover, ObjectNotFoundError, Storage, _scratch_dir, check_key
from .local_leftovers import writer_running

__all__ = ["LocalStorage", "writer_running"]

TMP_MARK = ".tmp-"
SCRATCH_PREFIX = local_leftovers.SCRATCH_PREFIX
LOCK_SUFFIX = ".lock"  # beside a conditionally written key: serialises its compare-and-replace
#: Errors that say this process may not use the folder (or that it is no folder): a restart would meet them.
_NO_ACCESS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})
_thread_lock = threading.Lock()  # POSIX record locks exclude processes, not threads of one process


_host = local_leftovers.host


def _owner_tag() -> str:
    """``host@pid-``: who owns a scratch directory (hostnames may contain dashes, not '@')."""
    return f"{_host()}@{os.getpid()}-"


def _version(data: bytes) -> str:
    """The version token of a local object: a hash of its bytes (an unchanged object keeps it)."""
    return hashlib.sha256(data).hexdigest()[:32]


@contextmanager
def _locked(final: Path) -> Iterator[None]:
    """Hold ``final``'s lock file: an fcntl record lock (works on NFS too), and a lock for this process's threads."""
    with _thread_lock:
        fd = os.open(final.with_name(final.name + LOCK_SUFFIX), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the record lock


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` in ``path``, on disk (fsynced) before it is linked or renamed into place."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failed(message: str, e: OSError) -> StorageError:
    """``message`` as a StorageError; a StorageAccessError (permanent: exit 78 under ``spotguard run``)
    where the system refused access."""
    return (StorageAccessError if e.errno in _NO_ACCESS else StorageError)(message)


def _local_path(url: str) -> str:
    """The path a plain path or ``file://`` URL names. In a URL (RFC 8089) ``file:///x`` and
    ``file://localhost/x`` both mean ``/x``, ``%20`` a space, and any other host another machine."""
    if url[:7].lower() != "file://":
        return url
    try:
        parts = urlsplit(url)
    except ValueError as e:  # e.g. an unbalanced "[" in the host part
        raise ConfigError(f"invalid storage URL {url!r}: {e}") from None
    if parts.netloc.lower() not in ("", "localhost") or (parts.netloc and not parts.path):
        raise ConfigError(
            f"invalid storage URL {url!r}: a file:// URL names an absolute path on this machine "
            "(file:///PATH or file://localhost/PATH); give a relative path without file://"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"invalid storage URL {url!r}: write '?' as %3F and '#' as %23 in a file:// URL")
    return unquote(parts.path)


class LocalStorage(Storage):
    scheme = "file"
    links_files = True

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.root = Path(_local_path(url)).expanduser().absolute()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _folder(self, final: Path) -> None:
        """Create the folders of ``final`` that are missing, after ``_no_links``."""
        self._no_links(final)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:  # "File exists" would say nothing useful
            blocker = next((p for p in (final.parent, *final.parent.parents) if p.exists() and not p.is_dir()), None)
            if blocker is None:
                raise
            raise StorageAccessError(f"cannot write below {blocker}: it is a file, not a folder") from e
        self._no_links(final)  # created meanwhile by another process: checked again

    def _no_links(self, path: Path) -> None:
        """Refuse ``path`` when a folder between the root and it is a link: a save of ``step-N`` where
        ``step-N`` links elsewhere would clear and fill that folder, which is not this run's."""
        here = self.root
        for part in path.relative_to(self.root).parts[:-1]:
            here = here / part
            if here.is_symlink():
                raise StorageError(
                    f"{self.describe(here.relative_to(self.root).as_posix())} is a link to {os.readlink(here)}: "
                    "spotguard never writes or deletes through a link below its root"
                )

    def _tmp_path(self, final: Path) -> Path:
        # os.urandom-based name: never draws from the training's global `random`.
        return final.with_name(f"{final.name}{TMP_MARK}{_owner_tag()}{secrets.token_hex(4)}")

    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[BinaryIO]:
        final = self._path(key)
        self._folder(final)
        tmp = self._tmp_path(final)
        try:
            with open(tmp, "wb") as f:
                yield f  # type: ignore[misc]
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False, deadline: float | None = None) -> None:
        final = self._path(key)
        self._folder(final)
        tmp = self._tmp_path(final)
        try:
            _write_synced(tmp, data)
            if exclusive:
                try:
                    os.link(tmp, final)  # atomic and never replaces: write-once
                except FileExistsError as e:
                    if final.read_bytes() == data:  # a retried write of the same bytes: already done
                        return
                    raise CheckpointExistsError(f"{self.describe(key)} already exists") from e
            else:
                os.replace(tmp, final)
            _fsync_dir(final.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.get_bytes(key)
        return data, _version(data)

    def put_conditional(self, key: str, data: bytes, *, token: str | None, deadline: float | None = None) -> str:
        """Create-if-absent with a hard link (atomic, never replaces); replace-if-unchanged under the key's
        lock file, comparing the bytes' hash with ``token``. Either way the new bytes are written to a temp
        file and fsynced first, so a reader sees the old object or the new one, never a part."""
        final = self._path(key)
        if token is not None and not final.parent.is_dir():  # never recreate a folder deleted under a writer
            raise PreconditionFailedError(f"{self.describe(key)} was deleted")
        try:
            self._folder(final)
            tmp = self._tmp_path(final)
            try:
                _write_synced(tmp, data)
                with _locked(final):
                    if token is None:
                        try:
                            os.link(tmp, final)
                        except FileExistsError as e:
                            if final.read_bytes() == data:  # a retried write of the same bytes: ours
                                return _version(data)
                            raise PreconditionFailedError(f"{self.describe(key)} already exists") from e
                    else:
                        try:
                            current = _version(final.read_bytes())
                        except FileNotFoundError as e:
                            raise PreconditionFailedError(f"{self.describe(key)} was deleted") from e
                        if current not in (token, _version(data)):
                            raise PreconditionFailedError(f"{self.describe(key)} was changed by another writer")
                        os.replace(tmp, final)
                    _fsync_dir(final.parent)
            finally:
                tmp.unlink(missing_ok=True)
        except StorageError:  # PreconditionFailedError, or a folder that is a file (``_folder``)
            raise
        except OSError as e:
            raise _failed(f"cannot write {self.describe(key)}: {e}", e) from e
        return _version(data)

    def scratch(self) -> AbstractContextManager[Path]:
        self.root.mkdir(parents=True, exist_ok=True)
        local_leftovers.sweep(self.root)
        # Same filesystem: put_file becomes a hard link. The owner tag lets a later save sweep it.
        return _scratch_dir(self.root, _owner_tag())

    def put_file(self, key: str, path: Path, *, deadline: float | None = None, crc: Any = None) -> None:
        final = self._path(key)
        self._folder(final)
        tmp = self._tmp_path(final)
        try:
            try:
                os.link(path, tmp)  # no copy when the scratch file is on this filesystem
            except OSError:
                shutil.copyfile(path, tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"{self.describe(key)} does not exist") from e
        except OSError as e:
            raise _failed(f"cannot read {self.describe(key)}: {e}", e) from e

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFoundError(f"{self.describe(key)} does not exist")
        yield path

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """A folder that cannot be read raises ``StorageError`` (as S3's listing does): read as "no
        checkpoints", it would make a resume train from step 0 silently."""
        start = self.root
        if "/" in prefix:  # walk only the directory the prefix names
            start = self.root / check_key(prefix.rsplit("/", 1)[0])
            if any(p.is_symlink() for p in (start, *start.parents) if self.root in p.parents):
                return {}  # as the whole listing (links are not followed): nothing of this root is there
        if not self._listable(start):
            return {}
        sizes = {}

        def unreadable(e: OSError) -> None:
            if not isinstance(e, (FileNotFoundError, NotADirectoryError)):  # not deleted meanwhile
                raise _failed(f"cannot list {e.filename or start}: {e.strerror or e}", e) from e

        for dirpath, dirs, files in os.walk(start, onerror=unreadable):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            # Scratch directories of running saves; a file system's lost+found where the root is a
            # mount point (unreadable to others, never ours: it must not make every listing fail).
            # Only spotguard's exact temp names are hidden: a checkpoint's own ``data.tmp-1`` is listed.
            if rel == ".":
                dirs[:] = [d for d in dirs if not local_leftovers.SCRATCH_NAME.fullmatch(d) and d != "lost+found"]
            for name in files:
                if local_leftovers.TEMP_NAME.fullmatch(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    try:
                        sizes[key] = os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:  # deleted since the walk saw it
                        pass
                    except OSError as e:
                        raise _failed(f"cannot read {os.path.join(dirpath, name)}: {e.strerror or e}", e) from e
        return sizes

    def _listable(self, start: Path) -> bool:
        """True for a folder; False where nothing is stored yet (the root or the prefix's folder does not
        exist). Raises ``StorageError`` where the root cannot be reached or is no folder."""
        try:
            if not stat.S_ISDIR(os.stat(start).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(start))
        except FileNotFoundError:
            return False
        except OSError as e:
            if start != self.root and isinstance(e, NotADirectoryError):
                return False  # a prefix naming a file's "folder": nothing under it
            raise _failed(f"cannot list {self.describe()}: {e.filename or start}: {e.strerror or e}", e) from e
        return True

    def delete(self, keys: Iterable[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            self._no_links(path)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise _failed(f"cannot delete {self.describe(key)}: {e}", e) from e
            parents.add(path.parent)
        # Remove directories left empty (a deleted checkpoint leaves no step-N/ behind).
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError as e:
                    if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        break
                    raise
                parent = parent.parent

    def list_times(self, prefix: str = "") -> dict[str, float]:
        times = {}
        for key in self.list_sizes(prefix):
            try:
                times[key] = self._path(key).stat().st_mtime
            except FileNotFoundError:  # deleted since the listing
                pass
        return times

    def leftovers(self) -> builtins.list[Leftover]:
        return local_leftovers.find(self)

    def remove_leftover(self, item: Leftover) -> None:
        local_leftovers.remove(self, item)

    @staticmethod
    def failed(message: str, e: OSError) -> StorageError:
        return _failed(message, e)
