"""Azure Blob Storage through azure-storage-blob: ``az://container/prefix`` and ``abfs[s]://``.

URLs (the account comes from the URL when it names one, else from the environment):

- ``az://CONTAINER/PREFIX``: the account of ``AZURE_STORAGE_CONNECTION_STRING`` (an emulator such
  as Azurite, or an account key / SAS), else ``AZURE_STORAGE_ACCOUNT_NAME``.
- ``az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX``, and ``abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX``
  (the Data Lake form that Spark and adlfs use): that account, always through its Blob endpoint
  (``.dfs.`` becomes ``.blob.``; a hierarchical-namespace account serves the Blob API too).

Credentials: the connection string when it is set and names the same account, else azure-identity's
``DefaultAzureCredential`` (managed identity on a VM, ``az login``, ``AZURE_CLIENT_ID``/... service
principals, workload identity).

Transfers: large objects go up as blocks in parallel (``concurrency``), each with a Content-MD5
that the service checks, committed by one Put Block List; small ones in one Put Blob with a
Content-MD5. A CRC32 of the whole object, computed while spooling, is stored in the blob's metadata;
``local_copy`` downloads with concurrent ranged GETs pinned to the blob's ETag and checks it again (the
checkpoint layer then checks the manifest's SHA-256). The manifest is written with
``If-None-Match: *``: write-once, so two writers can never both commit one step.

Retries: each HTTP request (one block) is retried by the SDK's pipeline with our retry policy
(private-RNG backoff, stops at the caller's deadline; the SDK's own jitter is private too), each
whole operation with tenacity. Under a deadline an operation gets a client of its own with short
timeouts, as on S3. Random streams: azure-core draws a token-refresh jitter from the global
``random``; ``_install_private_jitter`` gives that one module a private generator.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

import azure.core.exceptions as aze
import requests
from azure.core import MatchConditions
from azure.storage.blob import BlobServiceClient
from azure.storage.blob._shared.authentication import AzureSigningError
from azure.storage.blob._shared.policies import StorageRetryPolicy, is_retry

from ..errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ConfigError,
    MissingDependencyError,
    StorageError,
)
from . import retry
from ._common import Crc32File, Progress, crc_b64, file_crc, split_url, temp_dir, tmp_parent
from .base import ObjectNotFoundError, Storage, check_key

logger = logging.getLogger(__name__)

MiB = 1 << 20
META_CRC = "spotguard_crc32"  # metadata names must be C# identifiers: no dashes
CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
_CONTAINER = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")
_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
_CHECKSUM_CODES = {"Md5Mismatch", "Crc64Mismatch"}  # a body damaged on the way: send it again
_TRANSIENT_CODES = {"ServerBusy", "OperationTimedOut", "InternalError", *_CHECKSUM_CODES}
_NETWORK = (aze.ServiceRequestError, aze.ServiceResponseError, aze.IncompleteReadError, aze.DecodeError,
            requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
            ConnectionError, TimeoutError)


def _install_private_jitter() -> None:
    """azure-core's bearer-token policy draws its refresh jitter from the global ``random``: give it its own."""
    import random

    from azure.core.pipeline.policies import _authentication

    if getattr(_authentication, "random", None) is random:
        _authentication.random = random.Random()  # type: ignore[assignment]


_install_private_jitter()


class _ChecksumMismatch(StorageError):
    """A downloaded object does not match the CRC32 stored with it (retried, then corrupt)."""


@dataclass
class AzureOptions:
    """Transfer and retry tuning; the defaults suit multi-GB checkpoints on one machine."""

    block_size: int = 16 * MiB  # Put Block size (Azure allows up to 4000 MiB, 50,000 blocks)
    single_put_threshold: int = 16 * MiB  # objects up to this size go up in one Put Blob
    concurrency: int = 8  # blocks in flight for uploads, ranges for downloads
    page_size: int = 1000  # names per List Blobs request (Azure maximum 5000)
    request_attempts: int = 4  # tries of one HTTP request (one block) before the operation fails
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    urgent_timeout: float = 5.0  # least connect/read timeout under a deadline (emergency saves)
    account_url: str | None = None  # Blob endpoint override (a private endpoint, an HTTPS emulator)
    retry: retry.RetryOptions = field(default_factory=retry.RetryOptions)

    def __post_init__(self) -> None:
        if not 64 * 1024 <= self.block_size <= 4000 * MiB or self.single_put_threshold < 1:
            raise ConfigError(f"block_size must be 64 KiB..4000 MiB, got {self.block_size}")
        if self.concurrency < 1 or self.request_attempts < 1 or not 1 <= self.page_size <= 5000:
            raise ConfigError(f"invalid Azure options {self!r}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0 or self.urgent_timeout <= 0:
            raise ConfigError("timeouts must be positive")


def _code(e: BaseException) -> str:
    code = getattr(e, "error_code", None) or ""
    return str(getattr(code, "value", code))  # the SDK gives a str enum or a plain str


class _RetryPolicy(StorageRetryPolicy):
    """The SDK's per-request retry with our backoff, never sleeping past ``deadline``.

    Beyond the SDK's rules (connection errors, 5xx, 408) it re-sends a request whose body the
    service refused for a checksum mismatch (one block damaged on the way is sent again, not the
    whole object), and never retries a failed credential (no token will come on a retry).
    """

    def __init__(self, attempts: int, wait: retry.JitteredBackoff, deadline: float | None) -> None:
        n = attempts - 1
        super().__init__(retry_total=n, retry_connect=n, retry_read=n, retry_status=n)
        self.wait, self.deadline = wait, deadline

    def send(self, request: Any) -> Any:
        settings = self.configure_retries(request)
        while True:
            try:
                response = self.next.send(request)
            except aze.AzureError as err:
                if isinstance(err, AzureSigningError) or not self.increment(settings, request.http_request, error=err):
                    raise
                self.sleep(settings, request.context.transport)
                continue
            http = response.http_response
            refused = http.status_code == 400 and http.headers.get("x-ms-error-code") in _CHECKSUM_CODES
            if (is_retry(response, settings["mode"]) or refused) and \
                    self.increment(settings, request.http_request, response=http):
                self.sleep(settings, request.context.transport)
                continue
            http.location_mode = settings["mode"]
            return response

    def increment(self, settings: dict[str, Any], request: Any, response: Any = None, error: Any = None) -> bool:
        if isinstance(error, aze.ClientAuthenticationError):
            return False
        if not super().increment(settings, request, response, error):
            return False
        settings["sleep"] = self.wait.delay(settings["count"])
        return self.deadline is None or time.monotonic() + settings["sleep"] < self.deadline

    def sleep(self, settings: dict[str, Any], transport: Any) -> None:
        transport.sleep(settings.get("sleep", 0.0))


def parse_url(url: str) -> tuple[str, str | None, str | None, str]:
    """``(container, account or None, blob host or None, prefix)`` of an ``az://``/``abfs[s]://`` URL."""
    scheme = urlparse(url).scheme
    if scheme not in ("az", "abfs", "abfss"):
        raise ConfigError(f"invalid storage URL {url!r}: expected az://CONTAINER/PREFIX")
    netloc, prefix = split_url(url, scheme)
    container, at, host = netloc.partition("@")
    account = None
    if at:
        account, _, suffix = host.partition(".")
        if suffix.startswith("dfs."):
            suffix = "blob." + suffix[len("dfs."):]
        if not _ACCOUNT.match(account) or not suffix.startswith("blob.") or ":" in suffix:
            raise ConfigError(f"invalid storage URL {url!r}: expected {scheme}://CONTAINER@ACCOUNT.blob.core.windows.net"
                              "/PREFIX (or ACCOUNT.dfs.core.windows.net)")
        host = f"{account}.{suffix}"
    elif scheme != "az":
        raise ConfigError(f"invalid storage URL {url!r}: expected {scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX")
    if not _CONTAINER.match(container):
        raise ConfigError(f"invalid storage URL {url!r}: container {container!r} must be 3-63 lowercase letters, "
                          "digits or single dashes")
    return container, account, host or None, prefix


def _connection_account(conn: str) -> str | None:
    fields = dict(part.split("=", 1) for part in conn.strip().rstrip(";").split(";") if "=" in part)
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        return "devstoreaccount1"
    return fields.get("AccountName")


class AzureStorage(Storage):
    scheme = "az"

    def __init__(self, url: str, options: AzureOptions | None = None, *, credential: Any = None) -> None:
        super().__init__(url)
        self.container_name, account, host, self.prefix = parse_url(url)
        self.options = options or AzureOptions()
        #: Optional byte-count callback for transfers (the CLI's progress bars).
        self.progress: Progress | None = None
        self._wait = retry.JitteredBackoff(self.options.retry)
        conn = os.environ.get(CONNECTION_STRING, "").strip()
        self._conn: str | None = None
        self._account_url = self.options.account_url
        if conn and credential is None and (account is None or account == _connection_account(conn)):
            self._conn, self.account = conn, _connection_account(conn) or account
        else:
            self.account = account or os.environ.get(ACCOUNT_NAME, "").strip() or None
            if self.account is not None and not _ACCOUNT.match(self.account):
                raise ConfigError(f"{ACCOUNT_NAME}={self.account!r} is not a storage account name (3-24 lowercase "
                                  "letters or digits)")
            if self._account_url is None:
                if self.account is None:
                    raise ConfigError(f"{url!r} names no storage account: use az://{self.container_name}@ACCOUNT"
                                      f".blob.core.windows.net/..., or set {ACCOUNT_NAME} (or {CONNECTION_STRING})")
                self._account_url = f"https://{host or self.account + '.blob.core.windows.net'}"
        self._credential = credential
        self._lock = threading.Lock()
        self.container = self._make_client(None)

    # -- clients -------------------------------------------------------------------------------
    def _default_credential(self) -> Any:
        with self._lock:
            if self._credential is None:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError as e:
                    raise MissingDependencyError(f"{self.url!r} needs azure-identity for its credentials ({e.name}): "
                                                 "pip install 'spotguard[azure]'") from e
                self._credential = DefaultAzureCredential()
            return self._credential

    def _make_client(self, deadline: float | None) -> Any:
        """A container client; under a deadline, with short timeouts and the deadline in its retry policy."""
        o = self.options
        timeout = None if deadline is None else min(o.read_timeout, max(o.urgent_timeout, (deadline - time.monotonic()) / 3))
        session = requests.Session()  # a pool large enough for every block in flight
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max(10, 2 * o.concurrency))
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        from azure.core.pipeline.transport import RequestsTransport

        kwargs: dict[str, Any] = dict(
            transport=RequestsTransport(session=session, session_owner=True,
                                        connection_timeout=min(o.connect_timeout, timeout or o.connect_timeout),
                                        read_timeout=timeout or o.read_timeout),
            retry_policy=_RetryPolicy(o.request_attempts, self._wait, deadline),
            max_single_put_size=o.single_put_threshold, max_block_size=o.block_size,
            max_single_get_size=o.block_size, max_chunk_get_size=o.block_size)
        if self._conn:
            try:
                if o.account_url:  # the connection string's key, another endpoint
                    with BlobServiceClient.from_connection_string(self._conn) as parsed:
                        service = BlobServiceClient(o.account_url, credential=parsed.credential, **kwargs)
                else:
                    service = BlobServiceClient.from_connection_string(self._conn, **kwargs)
            except ValueError as e:
                raise ConfigError(f"{CONNECTION_STRING} cannot be read: {e}") from e
        else:
            assert self._account_url is not None  # set in __init__ whenever there is no connection string
            service = BlobServiceClient(self._account_url, credential=self._credential or self._default_credential(),
                                        **kwargs)
        return service.get_container_client(self.container_name)

    @contextmanager
    def _client_for(self, deadline: float | None) -> Iterator[Any]:
        if deadline is None:
            yield self.container
            return
        client = self._make_client(deadline)
        try:
            yield client
        finally:
            client.close()

    # -- retries and errors --------------------------------------------------------------------
    @staticmethod
    def _transient(e: BaseException) -> bool:
        if isinstance(e, aze.ClientAuthenticationError):
            return False
        if isinstance(e, _NETWORK):
            return True
        if isinstance(e, aze.HttpResponseError):
            status = e.status_code or 0
            return (status >= 500 and status not in (501, 505)) or status in (408, 429) \
                or _code(e) in _TRANSIENT_CODES
        return False

    def _call(self, what: str, key: str, fn: Any, deadline: float | None = None) -> Any:
        try:
            return retry.call(fn, options=self.options.retry, transient=self._transient, deadline=deadline,
                              what=f"{what} {self.describe(key)}", wait=self._wait)
        except (CheckpointExistsError, ConfigError, MissingDependencyError):
            raise
        except (aze.AzureError, requests.RequestException, OSError, ValueError) as e:
            if isinstance(e, StorageError) and not isinstance(e, _ChecksumMismatch):
                raise
            raise self._error(what, key, e) from e

    def _error(self, what: str, key: str, e: BaseException) -> Exception:
        where = self.describe(key)
        code = _code(e)
        status = getattr(e, "status_code", None) or 0
        if isinstance(e, _ChecksumMismatch):
            return CheckpointCorruptError(f"{where}: {e}")
        if code == "ContainerNotFound":
            return StorageError(f"cannot {what} {where}: container {self.container_name!r} does not exist in account "
                                f"{self.account!r}; create it or fix the URL ({CONNECTION_STRING} for an emulator)")
        if isinstance(e, aze.ResourceNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist")
        if isinstance(e, aze.ClientAuthenticationError) and status == 0:  # no token: the credential chain failed
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return StorageError(f"cannot {what} {where}: no Azure credentials found ({first}); run `az login`, "
                                "attach a managed identity (AZURE_CLIENT_ID for a user-assigned one), set "
                                f"AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or {CONNECTION_STRING}")
        if isinstance(e, aze.ClientAuthenticationError) or status in (401, 403):
            detail = re.search(r"authenticationerrordetail:\s*(.+)", str(e), re.IGNORECASE)  # e.g. an expired token
            code = f"{code or status}: {detail.group(1).strip()}" if detail else (code or str(status))
            return StorageError(f"cannot {what} {where}: access denied ({code}); check the credentials "
                                "(managed identity, az login, connection string) and that they hold the 'Storage "
                                f"Blob Data Contributor' role on container {self.container_name!r}")
        if isinstance(e, aze.ServiceRequestError) and "resolve" in str(e).lower():
            return StorageError(f"cannot {what} {where} (gave up after retries): the account's endpoint does not "
                                f"resolve ({e}); check the account name {self.account!r} and the network")
        return StorageError(f"cannot {what} {where} (gave up after retries): {code or type(e).__name__}: {e}")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

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

    # -- writes --------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[BinaryIO]:
        """Spool to a local temp file (with a running CRC32), then upload it in parallel blocks."""
        with temp_dir(tmp_parent()) as d:
            spool = d / "spool"
            with open(spool, "wb") as raw:
                crc = Crc32File(raw)
                yield crc  # type: ignore[misc]
            self._upload(key, spool, crc.b64(), deadline)

    def put_file(self, key: str, path: Path, *, deadline: float | None = None) -> None:
        """Upload a local file in parallel blocks, straight from where it lies (no spool copy)."""
        self._upload(key, path, crc_b64(file_crc(path, zlib.crc32)), deadline)

    def _upload(self, key: str, spool: Path, crc: str, deadline: float | None) -> None:
        full = self._key(key)

        def upload(client: Any) -> None:
            with open(spool, "rb") as f:
                # validate_content: a Content-MD5 with every block (and a single Put Blob), checked by the service.
                client.get_blob_client(full).upload_blob(
                    f, overwrite=True, max_concurrency=self.options.concurrency, validate_content=True,
                    metadata={META_CRC: crc}, progress_hook=self._hook())

        with self._client_for(deadline) as client:
            self._call("upload", key, lambda: upload(client), deadline)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False,
                  deadline: float | None = None) -> None:
        full = self._key(key)
        if len(data) > self.options.single_put_threshold:
            raise ConfigError("put_bytes is for small objects; use open_write")

        def put(client: Any) -> None:
            blob = client.get_blob_client(full)
            try:
                # overwrite=False sends If-None-Match: * (write-once); the service answers 409 when the blob exists.
                blob.upload_blob(data, overwrite=not exclusive, validate_content=True,
                                 metadata={META_CRC: crc_b64(zlib.crc32(data))})
            except (aze.ResourceExistsError, aze.ResourceModifiedError) as e:
                # An earlier attempt may have landed although its reply was lost: same bytes = ours.
                if blob.download_blob().readall() == data:
                    logger.info("%s was already written by an earlier attempt", self.describe(key))
                    return
                raise CheckpointExistsError(f"{self.describe(key)} already exists") from e

        with self._client_for(deadline) as client:
            self._call("write", key, lambda: put(client), deadline)

    # -- reads ---------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        return bytes(self._call("read", key, lambda: self.container.get_blob_client(full).download_blob().readall()))

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """Download with concurrent ranged GETs of one version (ETag), then check the stored CRC32."""
        full = self._key(key)
        with temp_dir(tmp_parent()) as d:
            path = d / Path(key).name

            def fetch() -> None:
                blob = self.container.get_blob_client(full)
                props = blob.get_blob_properties()
                with open(path, "wb") as f:
                    # Pinned to the ETag: a blob replaced mid-download fails instead of mixing versions.
                    blob.download_blob(max_concurrency=self.options.concurrency, etag=props.etag,
                                       match_condition=MatchConditions.IfNotModified,
                                       progress_hook=self._hook()).readinto(f)
                size = path.stat().st_size
                if size != props.size:
                    raise _ChecksumMismatch(f"downloaded {size} bytes, the blob has {props.size}")
                want = (props.metadata or {}).get(META_CRC)
                if want is None:
                    logger.debug("%s has no stored CRC32; relying on the manifest's SHA-256", self.describe(key))
                    return
                got = crc_b64(file_crc(path))
                if got != want:
                    raise _ChecksumMismatch(f"CRC32 of the downloaded blob is {got}, the blob's metadata says {want}")

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
            blobs = self.container.list_blobs(name_starts_with=self.prefix + prefix,
                                              results_per_page=self.options.page_size)
            return {b.name[len(self.prefix):]: b.size for b in blobs}

        return dict(self._call("list", prefix, run))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            full = self._key(key)

            def run(name: str = full) -> None:
                try:
                    self.container.delete_blob(name)
                except aze.ResourceNotFoundError as e:
                    if _code(e) == "ContainerNotFound":
                        raise

            self._call("delete", key, run)

    def exists(self, key: str) -> bool:
        full = self._key(key)
        return bool(self._call("check", key, lambda: self.container.get_blob_client(full).exists()))

    def close(self) -> None:
        self.container.close()
