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
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import boto3
import botocore.exceptions as bex
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.handlers import VALID_BUCKET, VALID_S3_ARN
from s3transfer.exceptions import RetriesExceededError

from ..errors import ConfigError, StorageError
from . import s3_errors
from ._common import parallel_part, split_url
from .base import STEP_DIR, Leftover
from .cloud import CloudStorage, _ChecksumMismatch, _Conflict, urgent_timeout
from .options import TransferOptions
from .rangecrc import RangeCrcFile

MiB = 1 << 20
META_CRC = "spotguard-crc32"


@dataclass(kw_only=True)
class S3Options(TransferOptions):
    """Transfer and retry tuning; the defaults suit multi-GB checkpoints on one machine.
    ``retry``: the retry policy (``RetryOptions``)."""

    part_size: int = 16 * MiB  # multipart chunk size (S3 minimum 5 MiB, except the last part)
    multipart_threshold: int = 16 * MiB  # objects from this size up go multipart
    concurrency: int = 8  # parts in flight at once, for uploads and ranged downloads
    page_size: int = 1000  # keys per LIST request (S3's maximum)
    request_attempts: int = 4  # tries of one HTTP request (one part) before the operation fails
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    urgent_timeout: float = (
        5.0  # least connect/read timeout under a deadline (emergency saves): see cloud.urgent_timeout
    )
    endpoint_url: str | None = None  # None: boto3's chain (AWS_ENDPOINT_URL, config files)

    bounds: ClassVar[dict[str, Any]] = {
        "ints": {"part_size": 5 * MiB, "multipart_threshold": 1, "page_size": (1, 1000)},
        "urls": ("endpoint_url",),
    }


def _bad_endpoint(value: str) -> str:
    """Why boto3 refused the endpoint from its chain (S3Options.endpoint_url is checked on its own),
    naming the variable it came from."""
    var = next((v for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(v) == value), None)
    where = f"{var}={value!r}" if var else f"the S3 endpoint {value!r} (endpoint_url in the AWS config file)"
    fix = f"a scheme is needed, like http://{value}" if "://" not in value else "give http://HOST:PORT or https://HOST"
    return f"{where} is not a valid endpoint URL: {fix}"


class S3Storage(CloudStorage):
    scheme = "s3"
    holder = "S3"
    sdk_errors = (bex.BotoCoreError, bex.ClientError, Boto3Error, RetriesExceededError)
    options: S3Options

    def __init__(self, url: str, options: S3Options | None = None, *, client: Any = None) -> None:
        self.bucket, self.prefix = split_url(url, "s3")
        if not (VALID_BUCKET.match(self.bucket) or VALID_S3_ARN.match(self.bucket)):  # botocore's own check
            raise ConfigError(
                f"invalid S3 bucket name {self.bucket!r} in {url!r}: S3 bucket names are 3 to 63 lowercase "
                "letters, digits, '.' and '-' (botocore refuses anything but letters, digits, '.', '-', '_')"
            )
        super().__init__(url, options or S3Options())
        self._session: Any = None  # boto3 sessions are not thread-safe: clients are made under a lock
        self._session_lock = threading.Lock()
        self.deadline_clients = client is None  # an injected client is used as is
        self.client = client or self._make_client()

    def _shared_client(self) -> Any:
        return self.client

    def _make_client(self, deadline: float | None = None) -> Any:
        o = self.options
        timeout = urgent_timeout(o, deadline)
        # total_max_attempts=1: botocore's own retries draw jitter from the global random.
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=min(o.connect_timeout, timeout or o.connect_timeout),
            read_timeout=timeout or o.read_timeout,
            max_pool_connections=max(10, o.concurrency * 2),
            request_checksum_calculation="when_supported",
            response_checksum_validation="when_supported",
        )
        with self._session_lock:
            if self._session is None:
                self._session = boto3.session.Session()
            try:
                client = self._session.client("s3", endpoint_url=o.endpoint_url, config=config)
            except ValueError as e:
                if isinstance(e, bex.BotoCoreError) or not str(e).startswith("Invalid endpoint: "):
                    raise
                raise ConfigError(_bad_endpoint(str(e).removeprefix("Invalid endpoint: "))) from e
        client.meta.events.register("needs-retry.s3", functools.partial(self._needs_retry, deadline=deadline))
        return client

    # -- retries and errors: s3_errors -----------------------------------------------------------
    def _needs_retry(
        self, response: Any = None, attempts: int = 1, caught_exception: Any = None, **kw: Any
    ) -> float | None:
        """botocore hook: seconds to wait before re-sending one request, or None to give up."""
        if attempts >= self.options.request_attempts or not s3_errors.retryable(response, caught_exception):
            return None
        delay, deadline = self._wait.delay(attempts), kw.get("deadline")
        return None if deadline is not None and time.monotonic() + delay >= deadline else delay

    def _transient(self, e: BaseException) -> bool:
        return s3_errors.transient(e)

    def _error(self, what: str, key: str, e: BaseException) -> StorageError:
        return s3_errors.explain(
            e, f"cannot {what} s3://{self.bucket}/{self.prefix}{key}", self.bucket, self.describe(key)
        )

    # -- the SDK's calls -------------------------------------------------------------------------
    def _send(self, client: Any, key: str, path: Path, crc: str, size: int, deadline: float | None) -> None:
        """Parallel parts through boto3's transfer manager, with a full-object CRC32 that S3 checks.

        A copy of the CRC32 in user metadata lets local_copy check downloads against servers that
        do not keep the checksum (moto's PUT).
        """
        client.upload_file(
            str(path),
            self.bucket,
            self._key(key),
            Config=self._config(size),
            ExtraArgs={"ChecksumCRC32": crc, "Metadata": {META_CRC: crc}},
            Callback=self.progress,
        )

    streams = True

    def _stream(self, client: Any, key: str, growing: Any, deadline: float | None) -> None:
        """Parts read as the file lands (a non-seekable stream: boto3 reads each part into memory, at most
        ``concurrency + 2`` of ``2 * part_size``; up to 10,000 parts), each with a CRC32 S3 checks; the
        reader refuses a file whose CRC32 differs from the writer's (damaged on the local disk since)."""
        o = self.options
        config = TransferConfig(  # not _config(size): the size is not known yet
            multipart_threshold=o.multipart_threshold,
            multipart_chunksize=2 * o.part_size,
            max_concurrency=o.concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )
        config.max_in_memory_upload_chunks = o.concurrency + 2  # s3transfer's, not a boto3 argument
        reader = growing.reader(self.upload_crc)
        try:
            client.upload_fileobj(
                reader,
                self.bucket,
                self._key(key),
                Config=config,
                ExtraArgs={"ChecksumAlgorithm": "CRC32"},
                Callback=self.progress,
            )
        finally:
            reader.close()

    def _put(self, client: Any, full: str, data: bytes, exclusive: bool, deadline: float | None) -> None:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "Body": data, "ChecksumAlgorithm": "CRC32"}
        if exclusive:
            args["IfNoneMatch"] = "*"
        try:
            client.put_object(**args)
        except bex.ClientError as e:
            if exclusive and e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                raise _Conflict from e
            raise

    def _read_versioned(self, full: str, client: Any = None) -> tuple[bytes, str]:
        reply = (client or self.client).get_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
        return reply["Body"].read(), reply["ETag"]

    def _put_conditional(self, client: Any, full: str, data: bytes, token: str | None) -> str:
        """``If-None-Match: *`` creates only; ``If-Match: <ETag>`` replaces only that version (412 else)."""
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
        try:
            reply = client.put_object(Bucket=self.bucket, Key=full, Body=data, ChecksumAlgorithm="CRC32", **condition)
        except bex.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "PreconditionFailed" or (token is not None and code in ("NoSuchKey", "404")):
                raise _Conflict from e
            raise
        return str(reply["ETag"])

    def _read(self, full: str, client: Any = None) -> bytes:
        return (client or self.client).get_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")["Body"].read()  # type: ignore[no-any-return]

    def _fetch(self, full: str, path: Path) -> tuple[int | None, str | None, Any]:
        """Concurrent ranged GETs, checked against the CRC32 S3 holds for the object."""
        head = self.client.head_object(Bucket=self.bucket, Key=full, ChecksumMode="ENABLED")
        if "ContentLength" not in head:  # a reply cut inside its headers: a network fault, retried
            raise bex.ResponseStreamingError(error="incomplete HEAD response")
        # download_fileobj, not download_file: the latter names its temp file with the global random.
        with open(path, "wb") as raw:
            f = RangeCrcFile(raw)  # the CRC32 kept as the ranges land: no second read for it
            try:
                self.client.download_fileobj(
                    self.bucket,
                    full,
                    f,
                    ExtraArgs={"ChecksumMode": "ENABLED"},
                    Config=self._config(head["ContentLength"]),
                    Callback=self.progress,
                )
            except bex.FlexibleChecksumError as e:  # botocore checked the CRC32 S3 holds: corrupt, not a fault
                raise _ChecksumMismatch(f"CRC32 of the downloaded object differs from what S3 holds ({e})") from e
        # A multipart upload's CRC32 is of its parts' checksums (COMPOSITE; moto leaves the type out), unless
        # it was sent for the whole object (FULL_OBJECT): only that one is the file's.
        kind = head.get("ChecksumType") or ("COMPOSITE" if "-" in head.get("ETag", "") else "FULL_OBJECT")
        want = (head.get("ChecksumCRC32") if kind == "FULL_OBJECT" else None) or head.get("Metadata", {}).get(META_CRC)
        return head["ContentLength"], want, f.crc(head["ContentLength"])

    def _config(self, size: int) -> TransferConfig:
        """About one part per worker, between ``part_size`` and 8x it: every stream busy, few requests."""
        o = self.options
        return TransferConfig(
            multipart_threshold=o.multipart_threshold,
            multipart_chunksize=parallel_part(size, o.part_size, o.concurrency),
            max_concurrency=o.concurrency,
            use_threads=True,
            # classic: with awscrt installed (the aws extra) "auto" picks the CRT transfer client on some
            # instance types, which writes through no file object (RangeCrcFile) and has its own retries.
            preferred_transfer_client="classic",
        )

    def _list(self, full_prefix: str) -> Iterator[tuple[str, int]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": self.options.page_size}
        )
        return ((o["Key"], o["Size"]) for page in pages for o in page.get("Contents", []))

    def _delete_one(self, full: str) -> None:
        self._delete_batch([full])

    def delete(self, keys: Iterable[str]) -> None:
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), 1000):  # DeleteObjects takes at most 1000 keys
            batch = full[i : i + 1000]

            def run(batch: builtins.list[str] = batch) -> None:
                self._delete_batch(batch)

            self._call("delete", batch[0][len(self.prefix) :], run)

    def _delete_batch(self, batch: builtins.list[str]) -> None:
        out = self.client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
        )
        errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            e = errors[0]
            status = 500 if e.get("Code") == "InternalError" else 403
            raise bex.ClientError(
                {
                    "Error": {"Code": e.get("Code"), "Message": e.get("Message")},
                    "ResponseMetadata": {"HTTPStatusCode": status},
                },
                "DeleteObjects",
            )

    def _exists(self, full: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=full)
            return True
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise

    def _list_times(self, full_prefix: str) -> Iterator[tuple[str, float]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": self.options.page_size}
        )
        return ((o["Key"], o["LastModified"].timestamp()) for page in pages for o in page.get("Contents", []))

    def leftovers(self) -> builtins.list[Leftover]:
        """Unfinished multipart uploads (billed until aborted) of keys in this run's ``step-N/`` folders:
        other keys' uploads, another application's at the bucket root included, are never listed."""

        def run() -> builtins.list[Leftover]:
            found = []
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix + "step-"
            )
            for page in pages:
                for up in page.get("Uploads", []):
                    key = up["Key"][len(self.prefix) :]
                    top, _, rest = key.partition("/")
                    if STEP_DIR.fullmatch(top) and rest:
                        found += self._upload_leftover(key, up)
            return found

        return builtins.list(self._call("list uploads below", "", run))

    def _upload_leftover(self, key: str, up: dict[str, Any]) -> builtins.list[Leftover]:
        """One upload, its size and last change counted over its parts ([] once it is gone)."""
        size, modified = 0, up["Initiated"].timestamp()
        try:
            pages = self.client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
            )
            for page in pages:
                for part in page.get("Parts", []):
                    size += part["Size"]
                    modified = max(modified, part["LastModified"].timestamp())
        except bex.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "NoSuchUpload":  # completed or aborted meanwhile
                return []
            raise
        return [Leftover(key, "multipart upload", size, modified, ref=up["UploadId"])]

    def remove_leftover(self, item: Leftover) -> None:
        if item.kind != "multipart upload":
            raise ConfigError(f"{self.describe(item.key)}: not a leftover of S3 storage")

        def run() -> None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(item.key), UploadId=item.ref)
            except bex.ClientError as e:
                if e.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise

        self._call("abort the upload of", item.key, run)
