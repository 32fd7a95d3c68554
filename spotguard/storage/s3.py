"""Amazon S3 (and S3-compatible servers) through boto3: ``s3://bucket/prefix``.

Endpoint, region and credentials come from the standard boto3 chain (``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, instance roles ...). Large objects go through boto3's transfer manager (multipart,
concurrent parts) with a full-object CRC32 that S3 checks on completion; ``local_copy`` checks it
again after the download. The manifest is written with ``If-None-Match: *`` so two writers can
never both commit one step.

Retries, two layers, neither drawing from the global ``random``: each HTTP request (one part of a
multipart upload) is retried through botocore's ``needs-retry`` hook with our private-RNG backoff
(botocore's own retry uses the global ``random``, so it is switched off), and each whole operation
is retried with tenacity; both stop at the caller's deadline.
"""

from __future__ import annotations

import builtins
import functools
import logging
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import boto3
import botocore.exceptions as bex
from boto3.exceptions import Boto3Error, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from s3transfer.exceptions import RetriesExceededError

from ..errors import CheckpointCorruptError, CheckpointExistsError, ConfigError, StorageError
from . import retry
from ._common import Crc32File, Progress, crc_b64, file_crc, split_url, temp_dir, tmp_parent
from .base import ObjectNotFoundError, Storage, check_key

logger = logging.getLogger(__name__)

MiB = 1 << 20
META_CRC = "spotguard-crc32"
_PERMANENT = {"AccessDenied": "access denied", "AllAccessDisabled": "access denied",
              "InvalidAccessKeyId": "unknown access key", "SignatureDoesNotMatch": "bad secret key",
              "ExpiredToken": "expired credentials", "InvalidToken": "invalid credentials",
              "AccountProblem": "account problem", "InvalidBucketName": "invalid bucket name",
              "PermanentRedirect": "bucket is in another region", "AuthorizationHeaderMalformed": "wrong region"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded", "ConditionalRequestConflict", "BadDigest"}
_NETWORK = (bex.HTTPClientError, bex.ConnectionError, bex.IncompleteReadError, bex.ResponseStreamingError,
            bex.FlexibleChecksumError, RetriesExceededError)


class _ChecksumMismatch(StorageError):
    """A downloaded object does not match the checksum the server holds (retried, then corrupt)."""


@dataclass
class S3Options:
    """Transfer and retry tuning; the defaults suit multi-GB checkpoints on one machine."""

    part_size: int = 16 * MiB  # multipart chunk size (S3 minimum 5 MiB, except the last part)
    multipart_threshold: int = 16 * MiB  # objects from this size up go multipart
    concurrency: int = 8  # parts in flight at once, for uploads and ranged downloads
    page_size: int = 1000  # keys per LIST request (S3's maximum)
    request_attempts: int = 4  # tries of one HTTP request (one part) before the operation fails
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    urgent_timeout: float = 5.0  # least connect/read timeout under a deadline (emergency saves): see _make_client
    endpoint_url: str | None = None  # None: boto3's chain (AWS_ENDPOINT_URL, config files)
    retry: retry.RetryOptions = field(default_factory=retry.RetryOptions)

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be at least 5 MiB (S3 minimum), got {self.part_size}")
        if self.multipart_threshold < 1 or self.concurrency < 1 or self.request_attempts < 1:
            raise ConfigError(f"invalid S3 options {self!r}")
        if not 1 <= self.page_size <= 1000:
            raise ConfigError(f"page_size must be 1..1000, got {self.page_size}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0 or self.urgent_timeout <= 0:
            raise ConfigError("timeouts must be positive")


class S3Storage(Storage):
    scheme = "s3"

    def __init__(self, url: str, options: S3Options | None = None, *, client: Any = None) -> None:
        super().__init__(url)
        self.bucket, self.prefix = split_url(url, "s3")
        self.options = options or S3Options()
        #: Optional byte-count callback for transfers (the CLI's progress bars).
        self.progress: Progress | None = None
        self._wait = retry.JitteredBackoff(self.options.retry)
        self._session: Any = None  # boto3 sessions are not thread-safe: clients are made under a lock
        self._session_lock = threading.Lock()
        self._injected = client is not None
        self.client = client or self._make_client()

    @contextmanager
    def _client_for(self, deadline: float | None) -> Iterator[Any]:
        """The shared client; under a deadline, a client of this operation's own, closed after it.

        Its short timeouts keep one hung request from outlasting the deadline, and its retry hook
        holds the deadline: the hook runs in the transfer manager's worker threads, so the deadline
        must travel with the client, never through state shared with concurrent operations.
        """
        if deadline is None or self._injected:
            yield self.client
            return
        client = self._make_client(deadline)
        try:
            yield client
        finally:
            client.close()

    def _make_client(self, deadline: float | None = None) -> Any:
        o = self.options
        # Under a deadline: a third of the time left, within [urgent_timeout, read_timeout]. Long
        # enough for a large part on a slow server, short enough that a hung request is retried.
        timeout = None if deadline is None else min(o.read_timeout, max(o.urgent_timeout, (deadline - time.monotonic()) / 3))
        # total_max_attempts=1: botocore's own retries draw jitter from the global random.
        config = Config(retries={"total_max_attempts": 1, "mode": "standard"},
                        connect_timeout=min(o.connect_timeout, timeout or o.connect_timeout),
                        read_timeout=timeout or o.read_timeout, max_pool_connections=max(10, o.concurrency * 2),
                        request_checksum_calculation="when_supported",
                        response_checksum_validation="when_supported")
        with self._session_lock:
            if self._session is None:
                self._session = boto3.session.Session()
            client = self._session.client("s3", endpoint_url=o.endpoint_url, config=config)
        client.meta.events.register("needs-retry.s3", functools.partial(self._needs_retry, deadline=deadline))
        return client

    # -- retries -------------------------------------------------------------------------------
    def _needs_retry(self, response: Any = None, attempts: int = 1, caught_exception: Any = None, *,
                     deadline: float | None = None, **_: Any) -> float | None:
        """botocore hook: seconds to wait before re-sending one request, or None to give up."""
        if attempts >= self.options.request_attempts:
            return None
        if caught_exception is not None:
            if not isinstance(caught_exception, _NETWORK):
                return None
        elif response is None:
            return None
        else:
            http, parsed = response
            code = (parsed or {}).get("Error", {}).get("Code", "")
            if http.status_code < 500 and http.status_code != 429 and code not in _TRANSIENT_CODES:
                return None
        delay = self._wait.delay(attempts)
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay

    @staticmethod
    def _cause(e: BaseException) -> BaseException:
        """The ClientError inside boto3's S3UploadFailedError (raised ``from`` it)."""
        if isinstance(e, S3UploadFailedError) and isinstance(e.__cause__ or e.__context__, BaseException):
            return e.__cause__ or e.__context__  # type: ignore[return-value]
        return e

    @classmethod
    def _transient(cls, e: BaseException) -> bool:
        e = cls._cause(e)
        if isinstance(e, _NETWORK):
            return True
        if isinstance(e, bex.ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return status >= 500 or status == 429 or e.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
        return False

    def _call(self, what: str, key: str, fn: Any, deadline: float | None = None) -> Any:
        try:
            return retry.call(fn, options=self.options.retry, transient=self._transient, deadline=deadline,
                              what=f"{what} {self.describe(key)}", wait=self._wait)
        except (bex.BotoCoreError, bex.ClientError, Boto3Error, RetriesExceededError, _ChecksumMismatch) as e:
            raise self._error(what, key, self._cause(e)) from e

    def _error(self, what: str, key: str, e: BaseException) -> StorageError:
        where = f"s3://{self.bucket}/{self.prefix}{key}"
        if isinstance(e, _ChecksumMismatch):
            return CheckpointCorruptError(f"{where}: {e}")  # type: ignore[return-value]
        if isinstance(e, bex.NoCredentialsError):
            return StorageError(f"cannot {what} {where}: no AWS credentials found; set AWS_PROFILE or "
                                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or attach an instance role")
        if isinstance(e, bex.ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "NoSuchBucket":
                return StorageError(f"cannot {what} {where}: bucket {self.bucket!r} does not exist; create it "
                                    "or fix the URL (and AWS_ENDPOINT_URL / region)")
            if code in _PERMANENT or status == 403:
                return StorageError(f"cannot {what} {where}: {_PERMANENT.get(code, 'forbidden')} ({code or status});"
                                    " check the credentials (AWS_PROFILE, keys, instance role) and that the "
                                    f"bucket policy allows s3:GetObject/PutObject/ListBucket/DeleteObject on {self.bucket!r}")
            if self._transient(e):
                return StorageError(f"cannot {what} {where} (gave up after retries): {code or status}: {e}")
            return StorageError(f"cannot {what} {where}: {code or status}: {e}")
        if isinstance(e, bex.EndpointConnectionError):
            return StorageError(f"cannot {what} {where}: cannot reach the endpoint ({e}); check AWS_ENDPOINT_URL "
                                "and the network")
        return StorageError(f"cannot {what} {where} (gave up after retries): {type(e).__name__}: {e}")

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _callback(self) -> Any:
        return self.progress

    # -- writes --------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, key: str, *, deadline: float | None = None) -> Iterator[BinaryIO]:
        """Spool to a local temp file (with a running CRC32), then upload it in parallel parts."""
        with temp_dir(tmp_parent()) as d:
            spool = d / "spool"
            with open(spool, "wb") as raw:
                crc = Crc32File(raw)
                yield crc  # type: ignore[misc]
            self._upload(key, spool, crc.b64(), crc.size, deadline)

    def put_file(self, key: str, path: Path, *, deadline: float | None = None) -> None:
        """Upload a local file in parallel parts, straight from where it lies (no spool copy)."""
        self._upload(key, path, crc_b64(file_crc(path, zlib.crc32)), path.stat().st_size, deadline)

    def _upload(self, key: str, spool: Path, crc: str, size: int, deadline: float | None) -> None:
        full = self._key(key)
        # Full-object CRC32: S3 checks it for PUT and multipart. A copy in user metadata lets
        # local_copy check downloads against servers that do not keep the checksum (moto's PUT).
        extra = {"ChecksumCRC32": crc, "Metadata": {META_CRC: crc}}
        config = self._config(size)
        with self._client_for(deadline) as client:
            self._call("upload", key, lambda: client.upload_file(
                str(spool), self.bucket, full, ExtraArgs=extra, Config=config,
                Callback=self._callback()), deadline)

    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False,
                  deadline: float | None = None) -> None:
        full = self._key(key)
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "Body": data, "ChecksumAlgorithm": "CRC32"}
        if exclusive:
            args["IfNoneMatch"] = "*"

        def put(client: Any) -> None:
            try:
                client.put_object(**args)
            except bex.ClientError as e:
                if not exclusive or e.response.get("Error", {}).get("Code") != "PreconditionFailed":
                    raise
                # An earlier attempt may have landed although its reply was lost: same bytes = ours.
                if self._get(full, client) == data:
                    logger.info("%s was already written by an earlier attempt", self.describe(key))
                    return
                raise CheckpointExistsError(f"{self.describe(key)} already exists") from e

        with self._client_for(deadline) as client:
            self._call("write", key, lambda: put(client), deadline)

    # -- reads ---------------------------------------------------------------------------------
    def _get(self, full: str, client: Any = None) -> bytes:
        return (client or self.client).get_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")["Body"].read()

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        try:
            return self._call("read", key, lambda: self._get(full))  # type: ignore[no-any-return]
        except StorageError as e:
            raise self._not_found(key, e) from e

    def _not_found(self, key: str, e: StorageError) -> StorageError:
        cause = self._cause(e.__cause__) if e.__cause__ else None
        if isinstance(cause, bex.ClientError) and cause.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return ObjectNotFoundError(f"{self.describe(key)} does not exist")
        return e

    @contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """Download with concurrent ranged GETs, then check the CRC32 S3 holds for the object."""
        full = self._key(key)
        with temp_dir(tmp_parent()) as d:
            path = d / Path(key).name

            def fetch() -> None:
                head = self.client.head_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
                # download_fileobj, not download_file: the latter names its temp file with the global random.
                with open(path, "wb") as f:
                    self.client.download_fileobj(self.bucket, full, f, ExtraArgs={"ChecksumMode": "ENABLED"},
                                                 Config=self._config(head.get("ContentLength", 0)),
                                                 Callback=self._callback())
                self._check(full, path, head)

            for attempt in (1, 2):  # a mismatch may come from the transfer: download once more
                try:
                    self._call("download", key, fetch)
                    break
                except CheckpointCorruptError as e:
                    if attempt == 2:
                        raise
                    logger.warning("%s; downloading it again", e)
                except StorageError as e:
                    raise self._not_found(key, e) from e
            yield path

    def _config(self, size: int) -> TransferConfig:
        """About one part per worker, between ``part_size`` and 8x it: every stream busy, few requests."""
        o = self.options
        part = min(max(o.part_size, -(-size // o.concurrency)), 8 * o.part_size)
        return TransferConfig(multipart_threshold=o.multipart_threshold, multipart_chunksize=part,
                              max_concurrency=o.concurrency, use_threads=True, preferred_transfer_client="classic")

    def _check(self, full: str, path: Path, head: dict[str, Any]) -> None:
        if "ContentLength" not in head:  # a reply cut inside its headers: a network fault, retried
            raise bex.ResponseStreamingError(error="incomplete HEAD response")
        size = path.stat().st_size
        if size != head.get("ContentLength"):
            raise _ChecksumMismatch(f"downloaded {size} bytes, the object has {head['ContentLength']}")
        want = head.get("ChecksumCRC32") if head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" else None
        want = want or head.get("Metadata", {}).get(META_CRC)
        if want is None:
            logger.debug("s3://%s/%s has no full-object CRC32; relying on the manifest's SHA-256",
                         self.bucket, full)
            return
        got = crc_b64(file_crc(path))
        if got != want:
            raise _ChecksumMismatch(f"CRC32 of the downloaded object is {got}, S3 holds {want}")

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        if prefix:
            check_key(prefix.rstrip("/"))

        def run() -> dict[str, int]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix,
                PaginationConfig={"PageSize": self.options.page_size})
            return {o["Key"][len(self.prefix):]: o["Size"] for page in pages for o in page.get("Contents", [])}

        return dict(self._call("list", prefix, run))

    def delete(self, keys: Iterable[str]) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), 1000):  # DeleteObjects takes at most 1000 keys
            batch = full[i:i + 1000]

            def run(batch: list[str] = batch) -> None:
                out = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in batch], "Quiet": True})
                errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    e = errors[0]
                    raise bex.ClientError({"Error": {"Code": e.get("Code"), "Message": e.get("Message")},
                                           "ResponseMetadata": {"HTTPStatusCode": 500 if e.get("Code") == "InternalError" else 403}},
                                          "DeleteObjects")

            self._call("delete", batch[0][len(self.prefix):], run)

    def exists(self, key: str) -> bool:
        full = self._key(key)

        def run() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=full)
                return True
            except bex.ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return False
                raise

        return bool(self._call("check", key, run))

    def close(self) -> None:
        self.client.close()

    def abort_incomplete_uploads(self) -> builtins.list[str]:
        """Abort multipart uploads left by killed writers below the prefix (they are billed until then)."""

        def run() -> list[str]:
            aborted = []
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                Prefix=self.prefix)
            for page in pages:
                for up in page.get("Uploads", []):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted.append(f"s3://{self.bucket}/{up['Key']} (multipart upload {up['UploadId'][:12]}...)")
            return aborted

        return list(self._call("abort uploads", "", run))
