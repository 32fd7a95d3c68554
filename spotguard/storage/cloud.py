"""What the cloud backends (S3, GCS, Azure) share; each backend adds only its SDK's calls.

The base owns the flow, the backend the wire:

- writes: ``open_write`` spools to a local temp file while the running ``upload_crc`` (CRC32, or
  CRC32C for GCS, per-block digests for Azure) is kept, then ``_send`` uploads that file
  (``put_file`` skips the spool). The checksum travels with the upload so the server can check it.
- write-once: ``put_bytes(exclusive=True)`` calls ``_put``, which raises ``_Conflict`` when the
  key exists; the base reads the object back, since an earlier attempt may have landed although
  its reply was lost (same bytes: ours), else raises ``CheckpointExistsError``.
- conditional writes (the writer lease): ``put_conditional`` calls ``_put_conditional`` with the
  service's own precondition (S3 ``If-None-Match``/``If-Match``, GCS generations, Azure ETags),
  which raises ``_Conflict`` when it fails; the base reads the object back as for write-once.
- reads: ``local_copy`` has ``_fetch`` download into a temp file and report what the server holds
  (size, checksum); a mismatch is retried once as a new download, then the object is corrupt.
- every SDK call runs through ``_call``: tenacity retries (``retry.py``) of what ``_transient``
  accepts, never past the caller's deadline, then ``_error`` names the failure and its fix.

Under a deadline (an emergency save) a backend may give each operation a client of its own with
short timeouts (``_client_for``), so one hung request cannot outlast the deadline.
"""

from __future__ import annotations

import abc
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ..errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ConfigError,
    MissingDependencyError,
    PreconditionFailedError,
    StorageError,
)
from . import retry
from ._common import Crc32File, Progress, crc_b64, file_crc, temp_dir, tmp_parent
from .base import Storage, UploadCrc, check_key
from .growing import Upload, abandoned_on_error

logger = logging.getLogger(__name__)

V = TypeVar("V")  # what a listing maps each name to (a size, a time)


class _ChecksumMismatch(StorageError):
    """A downloaded object does not match the size or checksum the server holds (retried, then corrupt)."""


class _Conflict(Exception):
    """Raised by a backend's ``_put``: a write-once key already exists."""


def urgent_timeout(options: Any, deadline: float | None) -> float | None:
    """Per-request timeout under a deadline: a third of the time left, within [urgent_timeout, read_timeout].

    Long enough for a large part on a slow server, short enough that a hung request is retried.
    """
    if deadline is None:
        return None
    return float(min(options.read_timeout, max(options.urgent_timeout, (deadline - time.monotonic()) / 3)))


class CloudStorage(Storage):
    """A bucket (or container) and a key prefix, reached through a cloud SDK."""

    #: The checksum uploads carry and downloads are checked against: its name and running update.
    checksum_name = "CRC32"
    checksum_update: Callable[[Any, int], int] = staticmethod(zlib.crc32)
    #: The SDK's exceptions that ``_call`` turns into ``StorageError`` (through ``_error``).
    sdk_errors: tuple[type[BaseException], ...] = ()
    #: What the server holding the checksum is called in messages ("S3 holds ...").
    holder = "the server"
    #: Whether an operation under a deadline gets a client of its own (``_make_client``).
    deadline_clients = False

    prefix: str  # "" or ending in "/": set by the backend from its URL

    def __init__(self, url: str, options: Any) -> None:
        super().__init__(url)
        self.options = options
        #: Optional byte-count callback for transfers (the CLI's progress bars).
        self.progress: Progress | None = None
        self._wait = retry.JitteredBackoff(options.retry)

    # -- what a backend provides -----------------------------------------------------------------
    @abc.abstractmethod
    def _transient(self, e: BaseException) -> bool:
        """Whether ``e`` may pass on a retry (5xx, throttling, a reset connection)."""

    @abc.abstractmethod
    def _error(self, what: str, key: str, e: BaseException) -> Exception:
        """The error to raise for an SDK failure that retries did not cure, naming the likely fix."""

    @abc.abstractmethod
    def _send(self, client: Any, key: str, path: Path, crc: Any, size: int, deadline: float | None) -> None:
        """Upload the local file ``path`` as ``key`` (one attempt), carrying checksum ``crc`` (what
        ``_upload_checksum`` made of it: the base64 CRC by default)."""

    def _upload_checksum(self, key: str, crc: Any, path: Path, size: int) -> Any:
        """What ``_send`` carries, from the final state of ``upload_crc`` over the file."""
        return crc_b64(crc)

    @abc.abstractmethod
    def _put(self, client: Any, full: str, data: bytes, exclusive: bool, deadline: float | None) -> None:
        """Write a small object at once (one attempt); with ``exclusive``, raise ``_Conflict`` if it exists."""

    @abc.abstractmethod
    def _read(self, full: str, client: Any = None) -> bytes:
        """A small object's bytes."""

    @abc.abstractmethod
    def _fetch(self, full: str, path: Path) -> tuple[int | None, str | None, Any]:
        """Download ``full`` into ``path``; return the size and base64 checksum the server holds (None:
        unknown, or already checked as the download landed), and the file's checksum if the download
        kept it (None: ``_verify`` reads the file for it)."""

    @abc.abstractmethod
    def _list(self, full_prefix: str) -> Iterable[tuple[str, int]]:
        """(full name, size) of every object below ``full_prefix``, in-progress parts excluded."""

    @abc.abstractmethod
    def _delete_one(self, full: str) -> None:
        """Delete one object; a missing one is no error."""

    @abc.abstractmethod
    def _exists(self, full: str) -> bool:
        """Whether the object exists."""

    def _read_versioned(self, full: str, client: Any = None) -> tuple[bytes, str]:
        """A small object's bytes and the version token the service compares (ETag, generation)."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def _put_conditional(self, client: Any, full: str, data: bytes, token: str | None) -> str:
        """One attempt: create ``full`` if absent (``token`` None) or replace it if still version ``token``;
        the new token. Raises ``_Conflict`` when the service refuses the precondition."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def _shared_client(self) -> Any:
        """The client every operation uses, except those that get their own under a deadline."""
        return None

    def _make_client(self, deadline: float | None) -> Any:
        """A new client whose timeouts and request retries respect ``deadline`` (see ``_client_for``)."""
        raise NotImplementedError

    # -- plumbing ------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    @contextmanager
    def _client_for(self, deadline: float | None) -> Iterator[Any]:
        """The shared client; under a deadline, a client of this operation's own, closed after it.

        Its short timeouts keep one hung request from outlasting the deadline, and its retry hook
        holds the deadline: SDK hooks run in the transfer's worker threads, so the deadline must
        travel with the client, never through state shared with concurrent operations.
        """
        if deadline is None or not self.deadline_clients:
            yield self._shared_client()
            return
        client = self._make_client(deadline)
        try:
            yield client
        finally:
            client.close()

    def _call(self, what: str, key: str, fn: Callable[[], Any], deadline: float | None = None) -> Any:
        """Run ``fn`` with retries; SDK errors come out as StorageError (or a subclass)."""
        try:
            return retry.call(
                fn,
                options=self.options.retry,
                transient=self._transient,
                deadline=deadline,
                what=f"{what} {self.describe(key)}",
                wait=self._wait,
            )
        except _ChecksumMismatch as e:
            raise CheckpointCorruptError(f"{self.describe(key)}: {e}") from e
        except (StorageError, ConfigError, MissingDependencyError):
            raise
        except self.sdk_errors as e:
            raise self._error(what, key, e) from e

    # -- writes --------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[BinaryIO]:
        """Spool to a local temp file (with a running checksum), uploaded as it lands where the backend
        ``streams`` (``put_stream``), else once it is whole."""
        check_key(key)
        with temp_dir(tmp_parent()) as d:
            spool = d / "spool"
            up = Upload(self, key, spool, deadline) if self.streams else None
            with open(spool, "wb") as raw, abandoned_on_error(up):
                crc = Crc32File(raw, self.upload_crc, on_grow=up.grew if up else None)
                if up is not None:
                    up.attach(crc)
                yield crc  # type: ignore[misc]
            if up is not None:
                up.finish(crc.size, crc.crc)
                return
            self._upload(key, spool, self._upload_checksum(key, crc.crc, spool, crc.size), crc.size, deadline)

    @property
    def upload_crc(self) -> UploadCrc:
        return self.checksum_update

    def put_file(self, key: str, path: Path, *, deadline: float | None = None, crc: Any = None) -> None:
        """Upload a local file straight from where it lies (no spool copy).

        ``crc`` (the writer's, kept while it wrote the file) is what the service checks the bytes it
        receives against: a file damaged on the local disk since is refused, not stored. Without it
        the file is read once more to compute it.
        """
        check_key(key)
        if crc is None:
            crc = file_crc(path, self.upload_crc)
        size = path.stat().st_size
        self._upload(key, path, self._upload_checksum(key, crc, path, size), size, deadline)

    def put_stream(self, key: str, growing: Any, *, deadline: float | None = None) -> None:
        """Upload the file a writer is appending to, part by part as it lands (``streams``); each attempt
        reads it again from the start. Nothing is stored if the writer fails (``growing.WriterFailed``)."""
        check_key(key)
        with self._client_for(deadline) as client:
            self._call("upload", key, lambda: self._stream(client, key, growing, deadline), deadline)

    def _stream(self, client: Any, key: str, growing: Any, deadline: float | None) -> None:
        """One attempt of ``put_stream`` (backends with ``streams = True``)."""
        raise NotImplementedError

    def _upload(self, key: str, path: Path, crc: Any, size: int, deadline: float | None) -> None:
        with self._client_for(deadline) as client:
            self._call("upload", key, lambda: self._send(client, key, path, crc, size, deadline), deadline)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False, deadline: float | None = None) -> None:
        full = self._key(key)

        def put(client: Any) -> None:
            try:
                self._put(client, full, data, exclusive, deadline)
            except _Conflict as e:
                # An earlier attempt may have landed although its reply was lost: same bytes = ours.
                if self._read(full, client) == data:
                    logger.info("%s was already written by an earlier attempt", self.describe(key))
                    return
                raise CheckpointExistsError(f"{self.describe(key)} already exists") from e

        with self._client_for(deadline) as client:
            self._call("write", key, lambda: put(client), deadline)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        full = self._key(key)
        data, token = self._call("read", key, lambda: self._read_versioned(full))
        return bytes(data), str(token)

    def put_conditional(self, key: str, data: bytes, *, token: str | None, deadline: float | None = None) -> str:
        full = self._key(key)
        what = "already exists" if token is None else "was changed or deleted by another writer"

        def put(client: Any) -> str:
            try:
                return self._put_conditional(client, full, data, token)
            except _Conflict as e:
                # An earlier attempt may have landed although its reply was lost: same bytes = ours.
                try:
                    got, now = self._read_versioned(full, client)
                except Exception as read_error:
                    if self._transient(read_error):
                        raise  # retried as a whole: the write again, then this read
                    raise PreconditionFailedError(f"{self.describe(key)} {what}") from e
                if got == data:
                    logger.info("%s was already written by an earlier attempt", self.describe(key))
                    return now
                raise PreconditionFailedError(f"{self.describe(key)} {what}") from e

        with self._client_for(deadline) as client:
            return str(self._call("write", key, lambda: put(client), deadline))

    # -- reads ---------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        return bytes(self._call("read", key, lambda: self._read(full)))

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """Download the object, then check its size and checksum against what the server holds."""
        full = self._key(key)
        with temp_dir(tmp_parent()) as d:
            path = d / Path(key).name
            for attempt in (1, 2):  # a mismatch may come from the transfer: download once more
                try:
                    self._call("download", key, lambda: self._verify(full, path, *self._fetch(full, path)))
                    break
                except CheckpointCorruptError as e:
                    if attempt == 2:
                        raise
                    logger.warning("%s; downloading it again", e)
            yield path

    def _verify(self, full: str, path: Path, size: int | None, want: str | None, kept: Any = None) -> None:
        """``kept``: the checksum the download kept as it landed (``RangeCrcFile``); None: the file is read for it."""
        got_size = path.stat().st_size
        if size is not None and got_size != size:
            raise _ChecksumMismatch(f"downloaded {got_size} bytes, the object has {size}")
        if not want:
            logger.debug("%s: no %s left to check (none stored, or checked as it came)", full, self.checksum_name)
            return
        got = crc_b64(file_crc(path, self.checksum_update) if kept is None else kept)
        if got != want:
            raise _ChecksumMismatch(
                f"{self.checksum_name} of the downloaded object is {got}, {self.holder} holds {want}"
            )

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        return self._listing(prefix, self._list)

    def list_times(self, prefix: str = "") -> dict[str, float]:
        return self._listing(prefix, self._list_times)

    def _listing(self, prefix: str, lister: Callable[[str], Iterable[tuple[str, V]]]) -> dict[str, V]:
        """``lister``'s (full name, value) pairs under ``prefix``, retried, named below this storage's prefix."""
        if prefix:
            check_key(prefix.rstrip("/"))
        cut = len(self.prefix)
        return dict(
            self._call("list", prefix, lambda: {name[cut:]: value for name, value in lister(self.prefix + prefix)})
        )

    def _list_times(self, full_prefix: str) -> Iterable[tuple[str, float]]:
        """(full name, last change in seconds since the epoch) of what ``_list`` lists; none by default
        (ages unknown: ``spotguard rm --incomplete`` then judges nothing old)."""
        return ()

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            full = self._key(key)

            def run(name: str = full) -> None:
                self._delete_one(name)

            self._call("delete", key, run)

    def exists(self, key: str) -> bool:
        full = self._key(key)
        return bool(self._call("check", key, lambda: self._exists(full)))

    def close(self) -> None:
        client = self._shared_client()
        if client is not None:
            client.close()
