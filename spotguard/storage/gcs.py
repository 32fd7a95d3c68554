"""Google Cloud Storage through google-cloud-storage: ``gs://bucket/prefix``.

Credentials are application default credentials; ``STORAGE_EMULATOR_HOST`` selects an emulator
(anonymous credentials, as the client library does). Large objects (``composite_threshold``) go up
as parts in parallel, then one ``compose``; medium ones through resumable uploads in ``chunk_size``
chunks; small ones through one multipart request. Every upload carries a CRC32C that GCS checks, the
composed object's CRC32C must equal the file's, and ``local_copy`` checks it again after download. The manifest is
written with ``if_generation_match=0``: write-once, so two writers can never both commit a step.

Random streams: the library's own retries (api-core and resumable-media) draw jitter from the
global ``random``, so they are switched off (``retry=None``) and tenacity with a private RNG
retries instead; the client's background bucket-metadata fetches (which retry the same way) are
switched off too. Its multipart uploads draw the MIME boundary from the global ``random`` too;
``_private_boundary`` replaces that one function with one that reads ``os.urandom``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import google.api_core.exceptions as gexc
import google.auth.exceptions as aexc
import google_crc32c
import requests
from google.cloud import storage as gcs
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from ..errors import CheckpointCorruptError, CheckpointExistsError, ConfigError, StorageError
from . import retry
from ._common import Crc32File, Progress, crc_b64, file_crc, split_url, temp_dir, tmp_parent
from .base import ObjectNotFoundError, Storage, check_key

logger = logging.getLogger(__name__)

MiB = 1 << 20
_CHUNK_UNIT = 256 * 1024  # resumable chunks must be multiples of 256 KiB
PART_MARK = ".sg-part-"  # temporary parts of a composite upload; invisible to list()


def _crc32c(data: bytes, crc: int) -> int:
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    view = memoryview(data).cast("B")  # it wants read-only bytes: copy in bounded slices
    for i in range(0, len(view), 8 * MiB):
        crc = int(google_crc32c.extend(crc, bytes(view[i:i + 8 * MiB])))
    return crc


def _install_private_boundary() -> None:
    """Make multipart uploads take their MIME boundary from os.urandom, not the global ``random``."""
    try:
        from google.cloud.storage._media import _upload
    except ImportError:  # pragma: no cover - layout of older releases
        return
    fmt = getattr(_upload, "_BOUNDARY_FORMAT", "==============={:019d}==")

    def _private_boundary() -> bytes:
        return fmt.format(secrets.randbelow(2**63 - 1)).encode("utf-8")

    if callable(getattr(_upload, "get_boundary", None)):
        _upload.get_boundary = _private_boundary


_install_private_boundary()


class _ChecksumMismatch(StorageError):
    """A downloaded object does not match the CRC32C GCS holds (retried, then corrupt)."""


@dataclass
class GCSOptions:
    """Transfer and retry tuning."""

    chunk_size: int = 32 * MiB  # resumable chunk and composite part size (multiple of 256 KiB)
    resumable_threshold: int = 8 * MiB  # objects from this size up use resumable uploads
    composite_threshold: int = 64 * MiB  # from this size up: parallel parts, then one compose (0: never)
    concurrency: int = 8  # parts in flight for composite uploads
    page_size: int = 1000  # keys per LIST request
    timeout: float = 60.0  # seconds per HTTP request (connect, read)
    project: str | None = None  # None: from the credentials / environment
    retry: retry.RetryOptions = field(default_factory=retry.RetryOptions)

    def __post_init__(self) -> None:
        if self.chunk_size < _CHUNK_UNIT or self.chunk_size % _CHUNK_UNIT:
            raise ConfigError(f"chunk_size must be a positive multiple of 256 KiB, got {self.chunk_size}")
        if self.resumable_threshold < 1 or not 1 <= self.page_size <= 5000 or self.timeout <= 0 \
                or self.concurrency < 1 or self.composite_threshold < 0:
            raise ConfigError(f"invalid GCS options {self!r}")


_TRANSIENT = (gexc.TooManyRequests, gexc.InternalServerError, gexc.BadGateway, gexc.ServiceUnavailable,
              gexc.GatewayTimeout, gexc.RequestRangeNotSatisfiable, requests.ConnectionError, requests.Timeout,
              requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError,
              aexc.TransportError, ConnectionError, TimeoutError)


class GCSStorage(Storage):
    scheme = "gs"

    def __init__(self, url: str, options: GCSOptions | None = None, *, client: Any = None) -> None:
        super().__init__(url)
        self.bucket_name, self.prefix = split_url(url, "gs")
        self.options = options or GCSOptions()
        #: Optional byte-count callback for transfers (the CLI's progress bars).
        self.progress: Progress | None = None
        self._wait = retry.JitteredBackoff(self.options.retry)
        self._client = client
        self._bucket: Any = None

    @property
    def bucket(self) -> Any:
        """Created on first use, so a missing credential is reported like any other storage error."""
        if self._bucket is None:
            try:
                if self._client is None:
                    kwargs = {"project": self.options.project} if self.options.project else {}
                    self._client = gcs.Client(**kwargs)  # type: ignore[attr-defined]
                    # Recent releases fetch bucket metadata (for tracing) in background threads, with
                    # api-core retries whose jitter comes from the global random: switch the cache off.
                    if getattr(self._client, "_bucket_metadata_cache", None) is not None:
                        self._client._bucket_metadata_cache = None
            except aexc.DefaultCredentialsError as e:
                raise StorageError(f"cannot open gs://{self.bucket_name}: no Google credentials found; run "
                                   "`gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, "
                                   "or run on a VM with a service account (STORAGE_EMULATOR_HOST for an emulator)"
                                   ) from e
            self._bucket = self._client.bucket(self.bucket_name)
        return self._bucket

    # -- retries -------------------------------------------------------------------------------
    @staticmethod
    def _transient(e: BaseException) -> bool:
        if isinstance(e, _TRANSIENT):
            return True
        if isinstance(e, InvalidResponse):  # resumable-media: unexpected status code
            status = getattr(e.response, "status_code", 0)
            return status >= 500 or status in (408, 429)
        return False

    def _call(self, what: str, key: str, fn: Any, deadline: float | None = None) -> Any:
        try:
            return retry.call(fn, options=self.options.retry, transient=self._transient, deadline=deadline,
                              what=f"{what} {self.describe(key)}", wait=self._wait)
        except (CheckpointExistsError, ConfigError):
            raise
        except (gexc.GoogleAPIError, aexc.GoogleAuthError, requests.RequestException, InvalidResponse,
                DataCorruption, OSError, ValueError) as e:
            if isinstance(e, StorageError) and not isinstance(e, _ChecksumMismatch):
                raise
            raise self._error(what, key, e) from e

    def _error(self, what: str, key: str, e: BaseException) -> Exception:
        where = f"gs://{self.bucket_name}/{self.prefix}{key}"
        if isinstance(e, (_ChecksumMismatch, DataCorruption)):
            return CheckpointCorruptError(f"{where}: {e}")
        if isinstance(e, gexc.NotFound):
            if "bucket" in str(e).lower() and "object" not in str(e).lower():
                return StorageError(f"cannot {what} {where}: bucket {self.bucket_name!r} does not exist; "
                                    "create it or fix the URL (and STORAGE_EMULATOR_HOST)")
            return ObjectNotFoundError(f"gs://{self.bucket_name}/{self.prefix}{key} does not exist")
        if isinstance(e, (gexc.Forbidden, gexc.Unauthorized, aexc.RefreshError)):
            return StorageError(f"cannot {what} {where}: access denied ({e}); check the credentials "
                                "(GOOGLE_APPLICATION_CREDENTIALS, the VM's service account) and that it has "
                                f"roles/storage.objectAdmin on bucket {self.bucket_name!r}")
        return StorageError(f"cannot {what} {where} (gave up after retries): {type(e).__name__}: {e}")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _timeout(self, deadline: float | None) -> float:
        """Per-request timeout; under a deadline, short enough that one hung request cannot outlast it."""
        left = retry.remaining(deadline)
        return self.options.timeout if left is None else max(1.0, min(self.options.timeout, left))

    # -- writes --------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[BinaryIO]:
        """Spool to a local temp file (with a running CRC32C), then upload it, resumable when large."""
        with temp_dir(tmp_parent()) as d:
            spool = d / "spool"
            with open(spool, "wb") as raw:
                crc = Crc32File(raw, _crc32c)
                yield crc  # type: ignore[misc]
            self._upload(key, spool, crc.b64(), crc.size, deadline)

    def put_file(self, key: str, path: Path, *, deadline: float | None = None) -> None:
        """Upload a local file (composite, resumable or simple by size), with no spool copy."""
        self._upload(key, path, crc_b64(file_crc(path, _crc32c)), path.stat().st_size, deadline)

    def _upload(self, key: str, spool: Path, crc: str, size: int, deadline: float | None) -> None:
        full = self._key(key)
        large = size >= self.options.resumable_threshold
        if self.options.composite_threshold and size >= self.options.composite_threshold:
            self._composite_upload(key, full, spool, size, crc, deadline)
            return

        def upload() -> None:
            blob = self.bucket.blob(full, chunk_size=self.options.chunk_size if large else None)
            blob.crc32c = crc  # sent with the upload: GCS rejects a mismatch
            blob.upload_from_filename(str(spool), checksum="crc32c", retry=None, timeout=self._timeout(deadline))
            if self.progress:
                self.progress(size)

        self._call("upload", key, upload, deadline)

    def _composite_upload(self, key: str, full: str, spool: Path, size: int, crc: str,
                          deadline: float | None) -> None:
        """Upload parts as temporary objects in parallel, compose them (at most 32), delete the parts.

        Each part carries its own CRC32C; the composed object's CRC32C (computed by GCS) must equal
        the CRC32C of the whole file, so a part mixed up or damaged cannot go unnoticed.
        """
        part = max(self.options.chunk_size, -(-size // (32 * _CHUNK_UNIT)) * _CHUNK_UNIT)
        token = secrets.token_hex(6)
        names = [f"{full}{PART_MARK}{token}-{i:02d}" for i in range(-(-size // part))]

        def send(i: int) -> None:
            with open(spool, "rb") as f:
                f.seek(i * part)
                data = f.read(part)
            self._call("upload part of", key, lambda: self.bucket.blob(names[i]).upload_from_string(
                data, checksum="crc32c", retry=None, timeout=self._timeout(deadline)), deadline)
            if self.progress:
                self.progress(len(data))

        try:
            with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="spotguard-gcs") as pool:
                for fut in [pool.submit(send, i) for i in range(len(names))]:
                    fut.result()

            def compose() -> None:
                dest = self.bucket.blob(full)
                dest.compose([self.bucket.blob(n) for n in names], retry=None, timeout=self._timeout(deadline))
                if dest.crc32c and dest.crc32c != crc:
                    raise StorageError(f"composed {self.describe(key)} has CRC32C {dest.crc32c}, the file {crc}")

            self._call("compose", key, compose, deadline)
        finally:
            try:
                self.delete([n[len(self.prefix):] for n in names])
            except StorageError as e:
                logger.warning("could not delete temporary parts of %s: %s", self.describe(key), e)

    def abort_incomplete_uploads(self) -> list[str]:
        """Delete temporary parts left by composite uploads that were killed."""
        names = self._call("list", "", lambda: [b.name for b in self.bucket.list_blobs(
            prefix=self.prefix, retry=None, timeout=self.options.timeout) if PART_MARK in b.name])
        self.delete([n[len(self.prefix):] for n in names])
        return [f"gs://{self.bucket_name}/{n}" for n in names]

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False,
                  deadline: float | None = None) -> None:
        full = self._key(key)

        def put() -> None:
            blob = self.bucket.blob(full)
            blob.crc32c = crc_b64(_crc32c(data, 0))
            try:
                # Below the library's resumable threshold: one multipart request, where GCS and
                # the emulators apply ifGenerationMatch=0.
                blob.upload_from_string(data, if_generation_match=0 if exclusive else None, checksum="crc32c",
                                        retry=None, timeout=self._timeout(deadline))
            except gexc.PreconditionFailed as e:
                # An earlier attempt may have landed although its reply was lost: same bytes = ours.
                if self.bucket.blob(full).download_as_bytes(retry=None, timeout=self._timeout(deadline)) == data:
                    logger.info("%s was already written by an earlier attempt", self.describe(key))
                    return
                raise CheckpointExistsError(f"{self.describe(key)} already exists") from e

        if len(data) >= 100 * MiB:
            raise ConfigError("put_bytes is for small objects; use open_write")
        self._call("write", key, put, deadline)

    # -- reads ---------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        return self._call("read", key, lambda: self.bucket.blob(full).download_as_bytes(  # type: ignore[no-any-return]
            checksum="crc32c", retry=None, timeout=self.options.timeout))

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """Download the object, then check its CRC32C against the one GCS holds."""
        full = self._key(key)
        with temp_dir(tmp_parent()) as d:
            path = d / Path(key).name

            def fetch() -> None:
                blob = self.bucket.get_blob(full, retry=None, timeout=self.options.timeout)
                if blob is None:
                    raise gexc.NotFound(f"No such object: {self.bucket_name}/{full}")
                blob.download_to_filename(str(path), checksum="crc32c", retry=None, timeout=self.options.timeout,
                                          if_generation_match=blob.generation)
                size = path.stat().st_size
                if blob.size is not None and size != blob.size:
                    raise _ChecksumMismatch(f"downloaded {size} bytes, the object has {blob.size}")
                if blob.crc32c:
                    got = crc_b64(file_crc(path, _crc32c))
                    if got != blob.crc32c:
                        raise _ChecksumMismatch(f"CRC32C of the downloaded object is {got}, GCS holds {blob.crc32c}")
                if self.progress:
                    self.progress(size)

            for attempt in (1, 2):  # a mismatch may come from the transfer: download once more
                try:
                    self._call("download", key, fetch)
                    break
                except CheckpointCorruptError as e:
                    if attempt == 2:
                        raise
                    logger.warning("%s; downloading it again", e)
            yield path

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        if prefix:
            check_key(prefix.rstrip("/"))

        def run() -> dict[str, int]:
            blobs = self.bucket.list_blobs(prefix=self.prefix + prefix, page_size=self.options.page_size,
                                           retry=None, timeout=self.options.timeout)
            return {b.name[len(self.prefix):]: b.size for b in blobs if PART_MARK not in b.name}

        return dict(self._call("list", prefix, run))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            blob_name = self._key(key)

            def run(name: str = blob_name) -> None:
                try:
                    self.bucket.delete_blob(name, retry=None, timeout=self.options.timeout)
                except gexc.NotFound:
                    pass

            self._call("delete", key, run)

    def exists(self, key: str) -> bool:
        full = self._key(key)
        return bool(self._call("check", key, lambda: self.bucket.blob(full).exists(
            retry=None, timeout=self.options.timeout)))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
