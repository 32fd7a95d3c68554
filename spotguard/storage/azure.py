"""Azure Blob Storage through azure-storage-blob: ``az://container/prefix`` and ``abfs[s]://``.

URLs (the account comes from the URL when it names one, else from the environment):

- ``az://CONTAINER/PREFIX``: the account of ``AZURE_STORAGE_CONNECTION_STRING`` (an emulator such
  as Azurite, or an account key / SAS), else ``AZURE_STORAGE_ACCOUNT_NAME``.
- ``az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX``, and ``abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX``
  (the Data Lake form that Spark and adlfs use): that account, always through its Blob endpoint
  (``.dfs.`` becomes ``.blob.``; a hierarchical-namespace account serves the Blob API too).

Credentials: the connection string when it is set and names the same account, else azure-identity's
``DefaultAzureCredential`` (managed identity on a VM, ``az login``, ``AZURE_CLIENT_ID``/... service
principals, workload identity). ``azure_client.py`` resolves both and builds the clients.

Transfers: large objects go up as blocks in parallel (``concurrency``), committed by one Put Block
List; small ones in one Put Blob. Each request carries a digest the service checks (CRC64, or MD5
without ``awscrt``) that the writer computed while it wrote the file (``azure_blocks.py``): a file
damaged on the local disk before its upload is refused, not stored. A CRC32 of the whole object,
computed in the same pass, is stored in the blob's metadata;
``local_copy`` downloads with concurrent ranged GETs pinned to the blob's ETag and checks it again (the
checkpoint layer then checks the manifest's SHA-256). The manifest is written with
``If-None-Match: *``: write-once, so two writers can never both commit one step.

Retries: each HTTP request (one block) is retried by the SDK's pipeline with our retry policy
(private-RNG backoff, stops at the caller's deadline; the SDK's own jitter is private too), each
whole operation with tenacity. Under a deadline an operation gets a client of its own with short
timeouts, as on S3. Random streams: see ``azure_client.py``.
"""

from __future__ import annotations

import logging
import re
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import azure.core.exceptions as aze
import requests
from azure.core import MatchConditions

from ..errors import ConfigError, MissingDependencyError, StorageAccessError, StorageError
from ._common import crc_b64, file_crc
from .azure_blocks import (
    KINDS,
    BlockChecksum,
    BlockSums,
    crc64_available,
    default_kind,
    digest_arg,
    stage_blocks,
    stream_blocks,
)
from .azure_client import CHECKSUM_CODES, CONNECTION_STRING, Account, RetryPolicy, error_code, parse_url
from .base import ObjectNotFoundError
from .cloud import CloudStorage, _Conflict, urgent_timeout
from .options import TransferOptions
from .rangecrc import RangeCrcFile

__all__ = ["META_CRC", "AzureOptions", "AzureStorage", "parse_url"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
META_CRC = "spotguard_crc32"  # metadata names must be C# identifiers: no dashes
_TRANSIENT_CODES = {"ServerBusy", "OperationTimedOut", "InternalError", *CHECKSUM_CODES}
_NETWORK = (
    aze.ServiceRequestError,
    aze.ServiceResponseError,
    aze.IncompleteReadError,
    aze.DecodeError,
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    ConnectionError,
    TimeoutError,
)


@dataclass(kw_only=True)
class AzureOptions(TransferOptions):
    """Transfer and retry tuning; the defaults suit multi-GB checkpoints on one machine.
    ``retry``: the retry policy (``RetryOptions``)."""

    block_size: int = 16 * MiB  # Put Block size (Azure allows up to 4000 MiB, 50,000 blocks)
    single_put_threshold: int = 16 * MiB  # objects up to this size go up in one Put Blob
    concurrency: int = 8  # blocks in flight for uploads, ranges for downloads
    page_size: int = 1000  # names per List Blobs request (Azure maximum 5000)
    request_attempts: int = 4  # tries of one HTTP request (one block) before the operation fails
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    urgent_timeout: float = 5.0  # least connect/read timeout under a deadline (emergency saves)
    account_url: str | None = None  # Blob endpoint override (a private endpoint, an HTTPS emulator)
    block_checksum: str = "auto"  # what each block carries for the service to check: "crc64", "md5", "auto"

    bounds: ClassVar[dict[str, Any]] = {
        "ints": {"block_size": (64 * 1024, 4000 * MiB), "single_put_threshold": 1, "page_size": (1, 5000)},
        "urls": ("account_url",),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_checksum not in ("auto", *KINDS):
            raise ConfigError(
                f"AzureOptions.block_checksum must be 'auto', 'crc64' or 'md5', got {self.block_checksum!r}"
            )


class AzureStorage(CloudStorage):
    scheme = "az"
    options: AzureOptions
    deadline_clients = True  # under a deadline, an operation gets a client with short timeouts
    sdk_errors = (aze.AzureError, requests.RequestException, OSError, ValueError)
    holder = "the blob's metadata"

    def __init__(self, url: str, options: AzureOptions | None = None, *, credential: Any = None) -> None:
        options = options or AzureOptions()
        self._account = Account(url, options.account_url, credential)
        self.container_name, self.prefix, self.account = (
            self._account.container,
            self._account.prefix,
            self._account.name,
        )
        super().__init__(url, options)
        kind = default_kind() if options.block_checksum == "auto" else options.block_checksum
        if kind == "crc64" and not crc64_available():
            raise MissingDependencyError(
                "AzureOptions(block_checksum='crc64') needs awscrt for a fast CRC64: pip install 'spotguard[azure]'"
            )
        self.block_checksum = BlockChecksum(options.block_size, kind)
        self.container = self._make_client(None)

    def _make_client(self, deadline: float | None) -> Any:
        """A container client; under a deadline, with short timeouts and the deadline in its retry policy."""
        policy = RetryPolicy(self.options.request_attempts, self._wait, deadline)
        return self._account.container_client(self.options, policy, urgent_timeout(self.options, deadline))

    def _shared_client(self) -> Any:
        return self.container

    # -- retries and errors --------------------------------------------------------------------
    def _transient(self, e: BaseException) -> bool:
        if isinstance(e, aze.ClientAuthenticationError):
            return False
        if isinstance(e, _NETWORK):
            return True
        if isinstance(e, aze.HttpResponseError):
            status = e.status_code or 0
            return (
                (status >= 500 and status not in (501, 505))
                or status in (408, 429)
                or error_code(e) in _TRANSIENT_CODES
            )
        return False

    def _error(self, what: str, key: str, e: BaseException) -> Exception:
        where = self.describe(key)
        code = error_code(e)
        status = getattr(e, "status_code", None) or 0
        if code == "ContainerNotFound":
            return StorageAccessError(
                f"cannot {what} {where}: container {self.container_name!r} does not exist in account "
                f"{self.account!r}; create it or fix the URL ({CONNECTION_STRING} for an emulator)"
            )
        if isinstance(e, aze.ResourceNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist")
        if isinstance(e, aze.ClientAuthenticationError) and status == 0:  # no token: the credential chain failed
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return StorageAccessError(
                f"cannot {what} {where}: no Azure credentials found ({first}); run `az login`, "
                "attach a managed identity (AZURE_CLIENT_ID for a user-assigned one), set "
                f"AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or {CONNECTION_STRING}"
            )
        if isinstance(e, aze.ClientAuthenticationError) or status in (401, 403):
            detail = re.search(r"authenticationerrordetail:\s*(.+)", str(e), re.IGNORECASE)  # e.g. an expired token
            code = f"{code or status}: {detail.group(1).strip()}" if detail else (code or str(status))
            return StorageAccessError(
                f"cannot {what} {where}: access denied ({code}); check the credentials "
                "(managed identity, az login, connection string) and that they hold the 'Storage "
                f"Blob Data Contributor' role on container {self.container_name!r}"
            )
        if code in CHECKSUM_CODES:
            return StorageError(
                f"cannot {what} {where}: Azure refused its bytes ({code}): they do not match the "
                f"{self.block_checksum.kind.upper()} computed when the file was written, so the local file was "
                "damaged or changed since (or every try was damaged on the way); nothing was stored"
            )
        if isinstance(e, aze.ServiceRequestError) and "resolve" in str(e).lower():
            return StorageError(
                f"cannot {what} {where} (gave up after retries): the account's endpoint does not "
                f"resolve ({e}); check the account name {self.account!r} and the network"
            )
        return StorageError(f"cannot {what} {where} (gave up after retries): {code or type(e).__name__}: {e}")

    def _hook(self) -> Any:
        """The SDK reports bytes done so far, from several threads; ``progress`` wants increments."""
        if self.progress is None:
            return None
        done, lock, progress = [0], threading.Lock(), self.progress

        def hook(current: int, _total: int | None) -> None:
            with lock:
                step, done[0] = current - done[0], max(done[0], current)
            if step > 0:
                progress(step)

        return hook

    # -- the SDK's calls -------------------------------------------------------------------------
    @property
    def upload_crc(self) -> BlockChecksum:
        """Per-block digests (and the CRC32 for the metadata), kept while a file is written."""
        return self.block_checksum

    def _upload_checksum(self, key: str, crc: Any, path: Path, size: int) -> BlockSums:
        sums = crc
        if not isinstance(sums, BlockSums) or sums.block_size != self.options.block_size:
            logger.debug("%s: block digests computed from the file (none kept for this block size)", key)
            sums = file_crc(path, self.block_checksum)
            if not isinstance(sums, BlockSums):  # an empty file: no data passed
                sums = self.block_checksum(b"", 0)
        if sums.size != size:
            raise StorageError(
                f"cannot upload {self.describe(key)}: {path} has {size} bytes, but {sums.size} were written; "
                "the local file was changed since it was written"
            )
        return sums

    def _send(self, client: Any, key: str, path: Path, crc: BlockSums, size: int, deadline: float | None) -> None:
        """One Put Blob (a file of one block at most) or staged blocks, each with the writer's digest."""
        blob = client.get_blob_client(self._key(key))
        metadata = {META_CRC: crc_b64(crc.crc32)}
        digests = crc.blocks()
        if len(digests) == 1 and size <= self.options.single_put_threshold:
            with open(path, "rb") as f:
                data = f.read()
            blob.upload_blob(data, overwrite=True, metadata=metadata, **{digest_arg(crc.kind): digests[0]})
            if self.progress is not None:
                self.progress(len(data))
            return
        stage_blocks(blob, path, crc, self.options.concurrency, metadata, self.progress)

    streams = True

    def put_stream(self, key: str, growing: Any, *, deadline: float | None = None) -> None:
        """Blocks staged as they land, each with the writer's digest (``stream_blocks``); a file that ends
        within ``single_put_threshold`` goes up whole once written (``put_file``: one Put Blob)."""
        threshold = self.options.single_put_threshold
        if growing.wait_for(threshold + 1) <= threshold:
            self.put_file(key, growing.path, deadline=deadline, crc=growing.crc)
        else:
            super().put_stream(key, growing, deadline=deadline)

    def _stream(self, client: Any, key: str, growing: Any, deadline: float | None) -> None:
        blob = client.get_blob_client(self._key(key))
        o = self.options
        stream_blocks(blob, growing, growing.live, o.block_size, o.concurrency, self.progress, META_CRC)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False, deadline: float | None = None) -> None:
        self._key(key)
        if len(data) > self.options.single_put_threshold:
            raise ConfigError("put_bytes is for small objects; use open_write")
        super().put_bytes(key, data, exclusive=exclusive, deadline=deadline)

    def _put(self, client: Any, full: str, data: bytes, exclusive: bool, deadline: float | None) -> None:
        try:
            # overwrite=False sends If-None-Match: * (write-once); the service answers 409 when the blob exists.
            client.get_blob_client(full).upload_blob(
                data, overwrite=not exclusive, validate_content=True, metadata={META_CRC: crc_b64(zlib.crc32(data))}
            )
        except (aze.ResourceExistsError, aze.ResourceModifiedError) as e:
            raise _Conflict from e

    def _put_conditional(self, client: Any, full: str, data: bytes, token: str | None) -> str:
        """``If-None-Match: *`` creates only (409 else); ``If-Match: <ETag>`` replaces only that version (412)."""
        condition: dict[str, Any] = (
            {"overwrite": False}
            if token is None
            else {"overwrite": True, "etag": token, "match_condition": MatchConditions.IfNotModified}
        )
        try:
            reply = client.get_blob_client(full).upload_blob(
                data, validate_content=True, metadata={META_CRC: crc_b64(zlib.crc32(data))}, **condition
            )
        except (aze.ResourceExistsError, aze.ResourceModifiedError) as e:
            raise _Conflict from e
        except aze.ResourceNotFoundError as e:
            if token is None or error_code(e) == "ContainerNotFound":
                raise
            raise _Conflict from e
        return str(reply["etag"])

    def _read_versioned(self, full: str, client: Any = None) -> tuple[bytes, str]:
        download = (client or self.container).get_blob_client(full).download_blob()
        return bytes(download.readall()), str(download.properties.etag)

    def _read(self, full: str, client: Any = None) -> bytes:
        return bytes((client or self.container).get_blob_client(full).download_blob().readall())

    def _fetch(self, full: str, path: Path) -> tuple[int | None, str | None, Any]:
        """Concurrent ranged GETs of one version (ETag), checked against the CRC32 in the blob's metadata."""
        blob = self.container.get_blob_client(full)
        props = blob.get_blob_properties()
        with open(path, "wb") as raw:
            f = RangeCrcFile(raw)  # the CRC32 kept as the ranges land: no second read for it
            # Pinned to the ETag: a blob replaced mid-download fails instead of mixing versions.
            blob.download_blob(
                max_concurrency=self.options.concurrency,
                etag=props.etag,
                match_condition=MatchConditions.IfNotModified,
                progress_hook=self._hook(),
            ).readinto(f)
        return props.size, (props.metadata or {}).get(META_CRC), f.crc(props.size)

    def _list(self, full_prefix: str) -> Iterator[tuple[str, int]]:
        blobs = self.container.list_blobs(name_starts_with=full_prefix, results_per_page=self.options.page_size)
        return ((b.name, b.size) for b in blobs)

    def _list_times(self, full_prefix: str) -> Iterator[tuple[str, float]]:
        blobs = self.container.list_blobs(name_starts_with=full_prefix, results_per_page=self.options.page_size)
        return ((b.name, b.last_modified.timestamp()) for b in blobs)

    def _delete_one(self, full: str) -> None:
        try:
            self.container.delete_blob(full)
        except aze.ResourceNotFoundError as e:
            if error_code(e) == "ContainerNotFound":
                raise

    def _exists(self, full: str) -> bool:
        return bool(self.container.get_blob_client(full).exists())
