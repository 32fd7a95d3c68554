"""What S3's errors mean: retry a request or the operation, or say what to fix.

Split from ``s3`` so the backend holds the SDK's calls only. botocore reports a refusal as a
``ClientError`` with a code; boto3's transfer manager wraps it (``S3UploadFailedError``), and the
network fails with its own exception types.
"""

from __future__ import annotations

from typing import Any

import botocore.exceptions as bex
from boto3.exceptions import S3UploadFailedError
from s3transfer.exceptions import RetriesExceededError

from ..errors import StorageAccessError, StorageError
from .base import ObjectNotFoundError

PERMANENT = {
    "AccessDenied": "access denied",
    "AllAccessDisabled": "access denied",
    "InvalidAccessKeyId": "unknown access key",
    "SignatureDoesNotMatch": "bad secret key",
    "ExpiredToken": "expired credentials",
    "InvalidToken": "invalid credentials",
    "AccountProblem": "account problem",
    "InvalidBucketName": "invalid bucket name",
    "PermanentRedirect": "bucket is in another region",
    "AuthorizationHeaderMalformed": "wrong region",
}
TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "ConditionalRequestConflict",
    "BadDigest",
}
NETWORK = (
    bex.HTTPClientError,
    bex.ConnectionError,
    bex.IncompleteReadError,
    bex.ResponseStreamingError,
    bex.FlexibleChecksumError,
    RetriesExceededError,
)


def retryable(response: Any, caught: Any) -> bool:
    """Whether one HTTP request may be sent again (botocore's ``needs-retry`` hook): a network failure,
    a 5xx, a 429 or a transient code."""
    if caught is not None:
        return isinstance(caught, NETWORK)
    if response is None:
        return False
    http, parsed = response
    code = (parsed or {}).get("Error", {}).get("Code", "")
    return http.status_code >= 500 or http.status_code == 429 or code in TRANSIENT_CODES


def cause(e: BaseException) -> BaseException:
    """The ClientError inside boto3's S3UploadFailedError (raised ``from`` it)."""
    if isinstance(e, S3UploadFailedError) and isinstance(e.__cause__ or e.__context__, BaseException):
        return e.__cause__ or e.__context__  # type: ignore[return-value]
    return e


def transient(e: BaseException) -> bool:
    """Whether a whole operation that failed with ``e`` may be tried again."""
    e = cause(e)
    if isinstance(e, NETWORK):
        return True
    if isinstance(e, bex.ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or e.response.get("Error", {}).get("Code") in TRANSIENT_CODES
    return False


def explain(e: BaseException, cannot: str, bucket: str, described: str) -> StorageError:
    """The ``StorageError`` for ``e``; ``cannot``: "cannot <what> s3://...", ``described``: the key as
    the storage describes it."""
    e = cause(e)
    if isinstance(e, bex.NoCredentialsError):
        return StorageAccessError(
            f"{cannot}: no AWS credentials found; set AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or attach an instance role"
        )
    if isinstance(e, bex.ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NoSuchBucket":
            return StorageAccessError(
                f"{cannot}: bucket {bucket!r} does not exist; create it or fix the URL (and AWS_ENDPOINT_URL / region)"
            )
        if code in ("NoSuchKey", "404"):
            return ObjectNotFoundError(f"{described} does not exist")
        if code in PERMANENT or status == 403:
            return StorageAccessError(
                f"{cannot}: {PERMANENT.get(code, 'forbidden')} ({code or status});"
                " check the credentials (AWS_PROFILE, keys, instance role) and that the "
                f"bucket policy allows s3:GetObject/PutObject/ListBucket/DeleteObject on {bucket!r}"
            )
        if transient(e):
            return StorageError(f"{cannot} (gave up after retries): {code or status}: {e}")
        return StorageError(f"{cannot}: {code or status}: {e}")
    if isinstance(e, bex.EndpointConnectionError):
        return StorageError(f"{cannot}: cannot reach the endpoint ({e}); check AWS_ENDPOINT_URL and the network")
    retried = " (gave up after retries)" if transient(e) else ""  # a ParamValidationError is never retried
    return StorageError(f"{cannot}{retried}: {type(e).__name__}: {e}")
