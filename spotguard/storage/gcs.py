"""Google Cloud Storage through google-cloud-storage: ``gs://bucket/prefix``.

Credentials are application default credentials; ``STORAGE_EMULATOR_HOST`` selects an emulator
(anonymous credentials, as the client library does). Large objects (``composite_threshold``) go up
as parts in parallel, then one ``compose``, and come down as ranged reads in parallel (the library's
``transfer_manager``, on threads); medium ones go up through resumable uploads in ``chunk_size``
chunks; small ones through one multipart request. Every upload carries a CRC32C that GCS checks, the
composed object's CRC32C must equal the file's, and ``local_copy`` checks the download against it.
The manifest is written with ``if_generation_match=0``: write-once, so two writers can never both
commit a step.

Random streams: the library's own retries (api-core and resumable-media) draw jitter from the
global ``random``, so they are switched off (``retry=None``) and tenacity with a private RNG
retries instead; the client's background bucket-metadata fetches (which retry the same way) are
switched off too. Its multipart uploads draw the MIME boundary from the global ``random`` too, and
no public option changes that: the first upload (never the import) replaces that one private function
with one that reads ``os.urandom`` (``_private_boundaries``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import google.api_core.exceptions as gexc
import google.auth.exceptions as aexc
import google_crc32c
import requests
from google.cloud import storage as gcs
from google.cloud.storage import transfer_manager  # type: ignore[attr-defined]
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from ..errors import ConfigError, StorageError
from . import gcs_compose, gcs_errors, retry
from ._common import crc_b64, parallel_part, split_url
from .base import GCS_PART_NAME, STEP_DIR, Leftover, check_key
from .cloud import CloudStorage, _Conflict
from .options import TransferOptions

logger = logging.getLogger(__name__)

MiB = 1 << 20
_CHUNK_UNIT = 256 * 1024  # resumable chunks must be multiples of 256 KiB


def _changed(blob: Any) -> float:
    """A blob's last change (seconds since the epoch); unknown counts as now (too young to remove)."""
    when = blob.updated or blob.time_created
    return when.timestamp() if when is not None else time.time()


def _crc32c(data: bytes, crc: int) -> int:
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    view = memoryview(data).cast("B")  # it wants read-only bytes: copy in bounded slices
    for i in range(0, len(view), 8 * MiB):
        crc = int(google_crc32c.extend(crc, bytes(view[i : i + 8 * MiB])))
    return crc


_patch_lock = threading.Lock()
_patched = False


def _private_boundaries() -> None:
    """Make multipart uploads take their MIME boundary from os.urandom, not the global ``random``.

    Applied by the first upload, not at import: importing spotguard changes nothing in the library.
    Idempotent and thread-safe (uploads start from several threads).
    """
    global _patched
    if _patched:
        return
    with _patch_lock:
        if _patched:
            return
        _patched = True
        try:
            from google.cloud.storage._media import _upload
        except ImportError:  # pragma: no cover - layout of older releases
            return
        if callable(getattr(_upload, "get_boundary", None)):
            fmt = getattr(_upload, "_BOUNDARY_FORMAT", "==============={:019d}==")

            def get_boundary() -> bytes:
                return fmt.format(secrets.randbelow(2**63 - 1)).encode("utf-8")

            _upload.get_boundary = get_boundary


@dataclass(kw_only=True)
class GCSOptions(TransferOptions):
    """Transfer and retry tuning; ``retry``: the retry policy (``RetryOptions``)."""

    chunk_size: int = 32 * MiB  # resumable chunk and composite part size (multiple of 256 KiB)
    resumable_threshold: int = 8 * MiB  # objects from this size up use resumable uploads
    composite_threshold: int = 64 * MiB  # from this size up: parallel parts (compose; ranged reads) (0: never)
    concurrency: int = 8  # parts in flight for composite uploads and sliced downloads
    page_size: int = 1000  # keys per LIST request
    timeout: float = 60.0  # seconds per HTTP request (connect, read)
    project: str | None = None  # None: from the credentials / environment

    bounds: ClassVar[dict[str, Any]] = {
        "ints": {"chunk_size": _CHUNK_UNIT, "resumable_threshold": 1, "composite_threshold": 0, "page_size": (1, 5000)},
        "strings": ("project",),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size % _CHUNK_UNIT:
            raise ConfigError(f"chunk_size must be a positive multiple of 256 KiB, got {self.chunk_size}")


class GCSStorage(CloudStorage):
    scheme = "gs"
    checksum_name = "CRC32C"
    checksum_update = staticmethod(_crc32c)
    holder = "GCS"
    sdk_errors = (
        gexc.GoogleAPIError,
        aexc.GoogleAuthError,
        requests.RequestException,
        InvalidResponse,
        DataCorruption,
        OSError,
        ValueError,
    )
    options: GCSOptions

    def __init__(self, url: str, options: GCSOptions | None = None, *, client: Any = None) -> None:
        self.bucket_name, self.prefix = split_url(url, "gs")
        super().__init__(url, options or GCSOptions())
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
                raise StorageError(
                    f"cannot open gs://{self.bucket_name}: no Google credentials found; run "
                    "`gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, "
                    "or run on a VM with a service account (STORAGE_EMULATOR_HOST for an emulator)"
                ) from e
            self._bucket = self._client.bucket(self.bucket_name)
        return self._bucket

    def _shared_client(self) -> Any:
        return self.bucket

    # -- retries and errors: gcs_errors ----------------------------------------------------------
    def _transient(self, e: BaseException) -> bool:
        return gcs_errors.transient(e)

    def _error(self, what: str, key: str, e: BaseException) -> Exception:
        return gcs_errors.explain(e, what, f"gs://{self.bucket_name}/{self.prefix}{key}", self.bucket_name)

    def _timeout(self, deadline: float | None) -> float:
        """Per-request timeout; under a deadline, short enough that one hung request cannot outlast it."""
        left = retry.remaining(deadline)
        return self.options.timeout if left is None else max(1.0, min(self.options.timeout, left))

    # -- writes --------------------------------------------------------------------------------
    def _upload(self, key: str, path: Path, crc: str, size: int, deadline: float | None) -> None:
        """Composite from ``composite_threshold`` up, else resumable or multipart by size."""
        _private_boundaries()
        if self.options.composite_threshold and size >= self.options.composite_threshold:
            self._composite_upload(key, path, size, crc, deadline)
        else:
            super()._upload(key, path, crc, size, deadline)

    def _send(self, client: Any, key: str, path: Path, crc: str, size: int, deadline: float | None) -> None:
        large = size >= self.options.resumable_threshold
        blob = client.blob(self._key(key), chunk_size=self.options.chunk_size if large else None)
        blob.crc32c = crc  # sent with the upload: GCS rejects a mismatch
        # checksum=None: the client would replace that CRC32C by its own of the bytes it reads now,
        # and so accept a file damaged since it was written (the writer computed ``crc`` then).
        blob.upload_from_filename(str(path), checksum=None, retry=None, timeout=self._timeout(deadline))
        if self.progress:
            self.progress(size)

    def _composite_upload(self, key: str, spool: Path, size: int, crc: str, deadline: float | None) -> None:
        """Parts in parallel, then composed (``gcs_compose``): up to 32 parts, of ``chunk_size`` at least."""
        part = max(self.options.chunk_size, -(-size // (32 * _CHUNK_UNIT)) * _CHUNK_UNIT)
        gcs_compose.upload(self, key, gcs_compose.file_parts(spool, size, part), lambda: crc, deadline)

    streams = True

    def put_stream(self, key: str, growing: Any, *, deadline: float | None = None) -> None:
        """From ``composite_threshold`` up, parts of ``chunk_size`` go up as they land, then are composed (and
        checked against the writer's CRC32C); a smaller file is uploaded whole once written, as ``put_file``."""
        check_key(key)
        _private_boundaries()
        threshold = self.options.composite_threshold
        if threshold and growing.wait_for(threshold) >= threshold:
            parts = gcs_compose.growing_parts(growing, self.options.chunk_size)
            gcs_compose.upload(self, key, parts, lambda: crc_b64(growing.crc), deadline)
        else:
            growing.wait_for(1 << 62)  # its end
            self.put_file(key, growing.path, deadline=deadline, crc=growing.crc)

    def leftovers(self) -> list[Leftover]:
        """Parts of composite uploads that were killed (``NAME.sg-part-TOKEN-NN`` in this run's
        ``step-N/`` folders): hidden from ``list()``, billed until deleted."""

        def run() -> list[Leftover]:
            blobs = self.bucket.list_blobs(
                prefix=self.prefix + "step-", page_size=self.options.page_size, retry=None, timeout=self.options.timeout
            )
            found = []
            for b in blobs:
                key = b.name[len(self.prefix) :]
                top, _, rest = key.partition("/")
                if STEP_DIR.fullmatch(top) and GCS_PART_NAME.fullmatch(rest):
                    found.append(Leftover(key, "upload part", b.size or 0, _changed(b)))
            return found

        return list(self._call("list upload parts below", "", run))

    def remove_leftover(self, item: Leftover) -> None:
        if item.kind != "upload part" or not GCS_PART_NAME.fullmatch(item.key):
            raise ConfigError(f"{self.describe(item.key)}: not a leftover of GCS storage")
        self.delete([item.key])

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False, deadline: float | None = None) -> None:
        if len(data) >= 100 * MiB:
            raise ConfigError("put_bytes is for small objects; use open_write")
        super().put_bytes(key, data, exclusive=exclusive, deadline=deadline)

    def _put(self, client: Any, full: str, data: bytes, exclusive: bool, deadline: float | None) -> None:
        self._upload_small(client, full, data, 0 if exclusive else None, self._timeout(deadline))

    def _put_conditional(self, client: Any, full: str, data: bytes, token: str | None) -> str:
        """``ifGenerationMatch``: 0 creates only; a generation replaces only that version (412 else)."""
        blob = self._upload_small(client, full, data, 0 if token is None else int(token), self.options.timeout)
        return str(blob.generation)

    def _upload_small(self, client: Any, full: str, data: bytes, generation: int | None, timeout: float) -> Any:
        """One multipart request (below the library's resumable threshold), checked by its CRC32C: the
        request where GCS and the emulators apply ``ifGenerationMatch`` (fake-gcs-server does there,
        gcp-storage-emulator ignores it). A precondition that fails is a ``_Conflict``."""
        _private_boundaries()
        blob = client.blob(full)
        blob.crc32c = crc_b64(_crc32c(data, 0))
        try:
            blob.upload_from_string(
                data, if_generation_match=generation, checksum="crc32c", retry=None, timeout=timeout
            )
        except gexc.PreconditionFailed as e:
            raise _Conflict from e
        return blob

    def _read_versioned(self, full: str, client: Any = None) -> tuple[bytes, str]:
        """The generation first, then those bytes only (pinned: a newer version fails, never mixes)."""
        blob = (client or self.bucket).get_blob(full, retry=None, timeout=self.options.timeout)
        if blob is None:
            raise gexc.NotFound(f"No such object: {self.bucket_name}/{full}")
        data = blob.download_as_bytes(
            checksum="crc32c", retry=None, timeout=self.options.timeout, if_generation_match=blob.generation
        )
        return data, str(blob.generation)

    # -- reads ---------------------------------------------------------------------------------
    def _read(self, full: str, client: Any = None) -> bytes:
        return (
            (client or self.bucket)
            .blob(full)
            .download_as_bytes(  # type: ignore[no-any-return]
                checksum="crc32c", retry=None, timeout=self.options.timeout
            )
        )

    def _fetch(self, full: str, path: Path) -> tuple[int | None, str | None, Any]:
        """From ``composite_threshold`` up, ranged reads in parallel, each range's CRC32C computed as it
        lands and their combination checked by the library once all have (nothing left for ``_verify``:
        one pass over the bytes); smaller objects in one stream, checked against the CRC32C GCS holds.
        A failed range fails the download once every other range has ended; it is then retried whole."""
        blob = self.bucket.get_blob(full, retry=None, timeout=self.options.timeout)
        if blob is None:
            raise gexc.NotFound(f"No such object: {self.bucket_name}/{full}")
        o = self.options
        # retry=None: the library's retries draw jitter from the global random (tenacity retries the whole).
        kwargs = {"retry": None, "timeout": o.timeout, "if_generation_match": blob.generation}
        if o.composite_threshold and blob.size >= o.composite_threshold:
            transfer_manager.download_chunks_concurrently(
                blob,
                str(path),
                chunk_size=parallel_part(blob.size, o.chunk_size, o.concurrency),
                download_kwargs=kwargs,
                worker_type=transfer_manager.THREAD,  # a process pool would pickle the client and its credentials
                max_workers=o.concurrency,
                crc32c_checksum=bool(blob.crc32c),  # none stored (some emulators): the manifest's checksum alone
            )
            want = None
        else:
            blob.download_to_filename(str(path), checksum="crc32c", **kwargs)
            want = blob.crc32c
        if self.progress:
            self.progress(path.stat().st_size)
        return blob.size, want, None

    def _list(self, full_prefix: str) -> Iterator[tuple[str, int]]:
        blobs = self.bucket.list_blobs(
            prefix=full_prefix, page_size=self.options.page_size, retry=None, timeout=self.options.timeout
        )
        return ((b.name, b.size) for b in blobs if not GCS_PART_NAME.fullmatch(b.name))

    def _list_times(self, full_prefix: str) -> Iterator[tuple[str, float]]:
        blobs = self.bucket.list_blobs(
            prefix=full_prefix, page_size=self.options.page_size, retry=None, timeout=self.options.timeout
        )
        return ((b.name, _changed(b)) for b in blobs if not GCS_PART_NAME.fullmatch(b.name))

    def _delete_one(self, full: str) -> None:
        try:
            self.bucket.delete_blob(full, retry=None, timeout=self.options.timeout)
        except gexc.NotFound:
            pass

    def _exists(self, full: str) -> bool:
        return bool(self.bucket.blob(full).exists(retry=None, timeout=self.options.timeout))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
