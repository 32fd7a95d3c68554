"""A checkpoint file's checksum computed on a thread of its own while the caller reads the file.

Why: a cold resume verified the whole file and then read it again (from the page cache) to load it,
one after the other: the disk's time plus the load's. Here the load follows a step behind the
check, so a resume takes about the longer of the two. The caller may read and copy ahead, but it
touches nothing it keeps before ``result()`` returned: the checksum still decides what is loaded.
"""

from __future__ import annotations

import threading
from pathlib import Path

from spotguard.checkpoint.format import digest
from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.errors import ChecksumMismatchError

ALG_NAMES = {digest.SHA256: "SHA-256", digest.BLAKE3: "BLAKE3", digest.XXH3: "XXH3-128"}


class _Cancelled(Exception):
    """Raised into the digest's walk by ``close()`` before it finished."""


class Verifying:
    """The check of ``path`` against its manifest ``entry``; ``where`` names it in errors.

    It starts at ``start()`` (or the first wait): a caller that reads a few scattered pages first (a
    zip's index) does so before the walk fills the disk's queue, not behind it.
    """

    def __init__(self, path: Path, entry: FileEntry, where: str) -> None:
        self._path, self._entry, self._where = path, entry, where
        self._cond = threading.Condition()
        self._read = 0  # bytes of the file the walk has read in so far
        self._done = self._cancel = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spotguard-verify-walk", daemon=True)

    def start(self) -> None:
        with self._cond:
            if self._thread.ident is None and not self._cancel:
                self._thread.start()

    def _run(self) -> None:
        try:
            got = digest.file_digest(self._path, self._entry.chunk_size, self._entry.alg, progress=self._advance)
            if got != self._entry.checksum:
                self._error = ChecksumMismatchError(
                    f"{self._where}: {ALG_NAMES[self._entry.alg]} checksum does not match the manifest"
                )
        except BaseException as e:  # re-raised by result() on the caller's thread
            self._error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _advance(self, end: int) -> None:
        with self._cond:
            if self._cancel:
                raise _Cancelled
            self._read = end
            self._cond.notify_all()

    @property
    def read(self) -> int:
        """Bytes of the file the check has read in so far."""
        return self._read

    def wait_read(self, end: int) -> None:
        """Return once the check has read the file up to ``end`` (those pages are cached) or has ended.

        A reader that waits here reads after the check rather than beside it: one sequential stream
        from the disk, not two competing ones.
        """
        self.start()
        with self._cond:
            self._cond.wait_for(lambda: self._done or self._read >= end)

    def result(self) -> None:
        """Wait for the check; raise ``CheckpointCorruptError`` when the file does not match its manifest
        (``CheckpointFormatError`` when its algorithm cannot be computed here)."""
        self.start()
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop a check still running (within one chunk) and wait for its thread (if it ever started)."""
        with self._cond:
            self._cancel = True
            if self._thread.ident is None:  # never started: a wait after this one ends, without a verdict
                self._done, self._error = True, self._error or RuntimeError(f"{self._where}: closed unchecked")
                self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
