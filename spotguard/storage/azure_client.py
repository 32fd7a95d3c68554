"""How an ``AzureStorage`` reaches its container: URL forms, account and credential, request retries.

Which account: the one the URL names (``CONTAINER@ACCOUNT.blob.core.windows.net``, or the Data Lake
form ``.dfs.``, always reached through its Blob endpoint), else the account of
``AZURE_STORAGE_CONNECTION_STRING``, else ``AZURE_STORAGE_ACCOUNT_NAME``. Which credential: the
connection string when it names that account, else azure-identity's ``DefaultAzureCredential``.

Random streams: azure-core's bearer-token policy draws a refresh jitter from the global
``random``; the first client built with a token credential (never the import) gives that one
module a private generator (``_private_token_jitter``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any
from urllib.parse import urlparse

import azure.core.exceptions as aze
import requests
from azure.storage.blob import BlobServiceClient
from azure.storage.blob._shared.authentication import AzureSigningError
from azure.storage.blob._shared.policies import StorageRetryPolicy, is_retry

from ..errors import ConfigError, MissingDependencyError
from . import retry
from ._common import split_url

CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
CHECKSUM_CODES = {"Md5Mismatch", "Crc64Mismatch"}  # a body damaged on the way: send it again
_CONTAINER = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")
_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")

_jitter_lock = threading.Lock()


def _private_token_jitter() -> None:
    """Give azure-core's bearer-token policy its own ``random.Random`` (idempotent, thread-safe)."""
    import random

    from azure.core.pipeline.policies import _authentication

    with _jitter_lock:
        if getattr(_authentication, "random", None) is random:
            _authentication.random = random.Random()  # type: ignore[assignment]


def error_code(e: BaseException) -> str:
    code = getattr(e, "error_code", None) or ""
    return str(getattr(code, "value", code))  # the SDK gives a str enum or a plain str


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
            suffix = "blob." + suffix[len("dfs.") :]
        if not _ACCOUNT.match(account) or not suffix.startswith("blob.") or ":" in suffix:
            raise ConfigError(
                f"invalid storage URL {url!r}: expected {scheme}://CONTAINER@ACCOUNT.blob.core.windows.net"
                "/PREFIX (or ACCOUNT.dfs.core.windows.net)"
            )
        host = f"{account}.{suffix}"
    elif scheme != "az":
        raise ConfigError(
            f"invalid storage URL {url!r}: expected {scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX"
        )
    if not _CONTAINER.match(container):
        raise ConfigError(
            f"invalid storage URL {url!r}: container {container!r} must be 3-63 lowercase letters, "
            "digits or single dashes"
        )
    return container, account, host or None, prefix


def _connection_account(conn: str) -> str | None:
    fields = dict(part.split("=", 1) for part in conn.strip().rstrip(";").split(";") if "=" in part)
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        return "devstoreaccount1"
    return fields.get("AccountName")


class RetryPolicy(StorageRetryPolicy):
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
            refused = http.status_code == 400 and http.headers.get("x-ms-error-code") in CHECKSUM_CODES
            if (is_retry(response, settings["mode"]) or refused) and self.increment(
                settings, request.http_request, response=http
            ):
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


class Account:
    """Where a container lives and how to authenticate; makes its container clients."""

    def __init__(self, url: str, account_url: str | None, credential: Any = None) -> None:
        self.url = url
        self.container, account, host, self.prefix = parse_url(url)
        conn = os.environ.get(CONNECTION_STRING, "").strip()
        self.conn: str | None = None
        self.account_url = account_url
        if conn and credential is None and (account is None or account == _connection_account(conn)):
            self.conn, self.name = conn, _connection_account(conn) or account
        else:
            self.name = account or os.environ.get(ACCOUNT_NAME, "").strip() or None
            if self.name is not None and not _ACCOUNT.match(self.name):
                raise ConfigError(
                    f"{ACCOUNT_NAME}={self.name!r} is not a storage account name (3-24 lowercase letters or digits)"
                )
            if self.account_url is None:
                if self.name is None:
                    raise ConfigError(
                        f"{url!r} names no storage account: use az://{self.container}@ACCOUNT"
                        f".blob.core.windows.net/..., or set {ACCOUNT_NAME} (or {CONNECTION_STRING})"
                    )
                self.account_url = f"https://{host or self.name + '.blob.core.windows.net'}"
        self._credential = credential
        self._lock = threading.Lock()

    def _token_credential(self) -> Any:
        with self._lock:
            if self._credential is None:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError as e:
                    raise MissingDependencyError(
                        f"{self.url!r} needs azure-identity for its credentials ({e.name}): "
                        "pip install 'spotguard[azure]'"
                    ) from e
                self._credential = DefaultAzureCredential()
            return self._credential

    def container_client(self, options: Any, policy: RetryPolicy, timeout: float | None) -> Any:
        """A container client with ``options``' transfer sizes, ``policy`` and ``timeout`` (None: the options')."""
        o = options
        session = requests.Session()  # a pool large enough for every block in flight
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max(10, 2 * o.concurrency))
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        from azure.core.pipeline.transport import RequestsTransport

        kwargs: dict[str, Any] = dict(
            transport=RequestsTransport(
                session=session,
                session_owner=True,
                connection_timeout=min(o.connect_timeout, timeout or o.connect_timeout),
                read_timeout=timeout or o.read_timeout,
            ),
            retry_policy=policy,
            max_single_put_size=o.single_put_threshold,
            max_block_size=o.block_size,
            max_single_get_size=o.block_size,
            max_chunk_get_size=o.block_size,
        )
        if self.conn:
            try:
                if o.account_url:  # the connection string's key, another endpoint
                    with BlobServiceClient.from_connection_string(self.conn) as parsed:
                        service = BlobServiceClient(o.account_url, credential=parsed.credential, **kwargs)
                else:
                    service = BlobServiceClient.from_connection_string(self.conn, **kwargs)
            except ValueError as e:
                raise ConfigError(f"{CONNECTION_STRING} cannot be read: {e}") from e
        else:
            assert self.account_url is not None  # set in __init__ whenever there is no connection string
            _private_token_jitter()
            service = BlobServiceClient(self.account_url, credential=self._token_credential(), **kwargs)
        return service.get_container_client(self.container)
