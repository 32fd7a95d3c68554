"""What Google Cloud Storage's errors mean: retry the operation, or say what to fix.

Split from ``gcs`` so the backend holds the client's calls only. api-core raises its HTTP errors,
resumable-media an ``InvalidResponse`` with the status, requests and google-auth their transport errors.
"""

from __future__ import annotations

import google.api_core.exceptions as gexc
import google.auth.exceptions as aexc
import requests
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from ..errors import CheckpointCorruptError, StorageAccessError, StorageError
from .base import ObjectNotFoundError

TRANSIENT = (
    gexc.TooManyRequests,
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.ServiceUnavailable,
    gexc.GatewayTimeout,
    gexc.RequestRangeNotSatisfiable,
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
    aexc.TransportError,
    ConnectionError,
    TimeoutError,
)


def transient(e: BaseException) -> bool:
    """Whether an operation that failed with ``e`` may be tried again."""
    if isinstance(e, TRANSIENT):
        return True
    if isinstance(e, InvalidResponse):  # resumable-media: unexpected status code
        status = getattr(e.response, "status_code", 0)
        return status >= 500 or status in (408, 429)
    return False


def explain(e: BaseException, what: str, where: str, bucket: str) -> Exception:
    """The error to raise for ``e`` while trying to ``what`` the object at ``where`` (a gs:// URL)."""
    if isinstance(e, DataCorruption):
        return CheckpointCorruptError(f"{where}: {e}")
    if isinstance(e, gexc.NotFound):
        if "bucket" in str(e).lower() and "object" not in str(e).lower():
            return StorageAccessError(
                f"cannot {what} {where}: bucket {bucket!r} does not exist; "
                "create it or fix the URL (and STORAGE_EMULATOR_HOST)"
            )
        return ObjectNotFoundError(f"{where} does not exist")
    if isinstance(e, (gexc.Forbidden, gexc.Unauthorized, aexc.RefreshError)):
        return StorageAccessError(
            f"cannot {what} {where}: access denied ({e}); check the credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS, the VM's service account) and that it has "
            f"roles/storage.objectAdmin on bucket {bucket!r}"
        )
    return StorageError(f"cannot {what} {where} (gave up after retries): {type(e).__name__}: {e}")
