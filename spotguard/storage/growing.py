"""The read side of a file still being written: an upload that starts before the file is whole.

Why: a save straight to a bucket wrote the whole state to a local spool file and only then uploaded
it, so an emergency save took the disk's time plus the network's. With ``GrowingFile`` the upload
reads each part as soon as the writer (``DirectFile``, through ``grew``) has put it on disk: the two
overlap, and the save takes about the slower of them.

Two rules keep a streamed upload from committing a wrong object: a read waits for bytes that are
not written yet and never comes back short before the writer has finished (an SDK takes a short
read for the end of the stream and would complete a truncated object), and a writer's failure
(an error, a cancelled save) is raised in the reader, so the upload is abandoned, never completed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from spotguard.errors import StorageError


class WriterFailed(StorageError):
    """The file a streamed upload reads was not finished: its writer failed or was cancelled."""


class GrowingFile:
    """A file one writer appends to (``grew``, then ``finish`` or ``fail``) and uploads read from."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._cond = threading.Condition()
        self._landed = 0  # bytes on disk, from the start
        self.size: int | None = None  # the final size, once finished
        self.crc: Any = None  # the writer's running upload checksum, once finished
        #: the writer's running upload checksum as it is now (``Upload.attach``); Azure's holds each block's digest
        self.live: Callable[[], Any] = lambda: None
        self._error: BaseException | None = None

    # -- the writer's side ---------------------------------------------------------------------
    def grew(self, landed: int) -> None:
        with self._cond:
            self._landed = landed
            self._cond.notify_all()

    def finish(self, size: int, crc: Any = None) -> None:
        with self._cond:
            self._landed, self.size, self.crc = size, size, crc
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- the readers' side ---------------------------------------------------------------------
    def wait_for(self, end: int) -> int:
        """Block until the first ``end`` bytes are on disk, or the file ended before; returns how many of
        them there are (less than ``end`` only at the end of the file). Raises ``WriterFailed``."""
        with self._cond:
            while self._error is None and self._landed < end and self.size is None:
                self._cond.wait()
            if self._error is not None:
                raise WriterFailed(f"{self.path.name} was not finished: {self._error}") from self._error
            return min(end, self._landed)

    def reader(self, crc: Callable[[Any, Any], Any] | None = None) -> Reader:
        """A new sequential reader from the start (each upload attempt takes its own). ``crc``: the
        running checksum the writer kept (``finish(crc=)``); the reader keeps it over what it reads and
        fails at the end when the two differ (the file was damaged on the disk since it was written)."""
        return Reader(self, crc)


class Reader:
    """A non-seekable binary stream over a ``GrowingFile``, for an SDK's streaming upload."""

    def __init__(self, growing: GrowingFile, crc: Callable[[Any, Any], Any] | None = None) -> None:
        self._growing = growing
        self._fd: int | None = None
        self._pos = 0
        self._update = crc
        self._crc: Any = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # the SDK then reads parts in order, as they land

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._growing.wait_for(self._pos + n if n >= 0 else 1 << 62)
        if self._fd is None:
            self._fd = os.open(self._growing.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        out = bytearray()
        while self._pos < end:
            chunk = os.pread(self._fd, end - self._pos, self._pos)
            if not chunk:  # the writer said these bytes are on disk: the file was cut under us
                raise WriterFailed(f"{self._growing.path.name} is shorter than its writer reported")
            out += chunk
            self._pos += len(chunk)
        if self._update is not None:
            self._crc = self._update(out, self._crc)
        if (n < 0 or len(out) < n) and self._update is not None and self._growing.crc is not None:
            if self._crc != self._growing.crc:  # the end: what was read is not what was written
                raise WriterFailed(
                    f"{self._growing.path.name} changed on the local disk after it was written (its checksum "
                    f"then {self._growing.crc}, now {self._crc}): not uploaded"
                )
        return bytes(out)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Upload:
    """``storage.put_stream(key)`` of the file at ``path`` on a thread of its own, started at once,
    fed by its writer (``grew``) and ended by it: ``finish`` waits for the upload, ``abandon`` stops it.

    An upload that fails while the file is still being written makes the writer's next buffer fail
    too (``grew`` raises), so a save does not write gigabytes for an upload that is already lost."""

    def __init__(self, storage: Any, key: str, path: str | Path, deadline: float | None) -> None:
        self.key, self.file = key, GrowingFile(path)
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(storage, key, deadline), name="spotguard-upload", daemon=True
        )
        self._thread.start()

    def _run(self, storage: Any, key: str, deadline: float | None) -> None:
        try:
            storage.put_stream(key, self.file, deadline=deadline)
        except BaseException as e:  # noqa: BLE001 - raised by finish() on the writer's thread
            self.error = e

    def attach(self, writer: Any) -> None:
        """The writer whose ``crc`` is the running upload checksum (read while it writes: Azure's blocks)."""
        self.file.live = lambda: writer.crc

    def grew(self, landed: int) -> None:
        if self.error is not None:
            raise WriterFailed(f"the upload of {self.file.path.name} failed: {self.error}") from self.error
        self.file.grew(landed)

    def finish(self, size: int, crc: Any = None) -> None:
        """The file is whole: wait for the upload to end; raise its error."""
        self.file.finish(size, crc)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abandon(self, error: BaseException, grace: float = 5.0) -> None:
        """The writer failed: the upload stops at its next read, and is never completed."""
        self.file.fail(error)
        self._thread.join(grace)


@contextmanager
def abandoned_on_error(up: Upload | None) -> Iterator[None]:
    """The block writes the file ``up`` streams (None: nothing streams): if it raises, the upload is
    abandoned, never completed with what was written so far."""
    try:
        yield
    except BaseException as e:
        if up is not None:
            up.abandon(e)
        raise
