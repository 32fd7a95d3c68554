"""Storage backends, one module each, chosen from a URL.

``open_storage("checkpoints/run-1")`` and ``file://...`` give local storage; ``s3://bucket/prefix``,
``gs://bucket/prefix`` and ``az://container/prefix`` (or ``abfs[s]://container@account.dfs.core.windows.net/prefix``)
give the cloud backends, whose SDKs are imported only when used.
"""

from __future__ import annotations

import importlib
import re
from urllib.parse import urlparse

from ..errors import ConfigError, MissingDependencyError
from . import timeouts
from .base import ObjectNotFoundError, Storage, check_key
from .local import LocalStorage

__all__ = ["LocalStorage", "ObjectNotFoundError", "Storage", "check_key", "open_storage", "register"]

# scheme -> ("module:Class", extra to install)
_BACKENDS: dict[str, tuple[str, str]] = {
    "file": ("spotguard.storage.local:LocalStorage", ""),
    "s3": ("spotguard.storage.s3:S3Storage", "aws"),
    "gs": ("spotguard.storage.gcs:GCSStorage", "gcp"),
    "az": ("spotguard.storage.azure:AzureStorage", "azure"),
    "abfs": ("spotguard.storage.azure:AzureStorage", "azure"),
    "abfss": ("spotguard.storage.azure:AzureStorage", "azure"),
}


#: A cloud URL with its "://" mistyped ("s3//b", "gs:/b", "s3:b"), which would otherwise be a local path.
_MISTYPED = re.compile(r"(s3|gs|gcs|az|abfss?)(?::/?(?!/)|//)", re.IGNORECASE)


def register(scheme: str, target: str, extra: str = "") -> None:
    """Make a backend available for URLs with ``scheme``."""
    _BACKENDS[scheme] = (target, extra)


def open_storage(url: str | Storage, *, timeout: float | None = None) -> Storage:
    """The backend for ``url`` (a path, ``file://``, ``s3://``, ``gs://``, ``az://``, ``abfs[s]://``), or ``url`` itself.

    ``timeout`` (seconds) bounds a cloud backend's requests and retries (``storage.timeouts``); local
    paths have none."""
    if timeout is not None:
        timeouts.check(timeout)
    if isinstance(url, Storage):
        return url
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"storage URL must be a non-empty string, got {url!r}")
    try:
        scheme = urlparse(url).scheme if "://" in url else "file"
    except ValueError as e:  # e.g. an unbalanced "[" in the host part
        raise ConfigError(f"invalid storage URL {url!r}: {e}") from None
    typo = _MISTYPED.match(url) if scheme == "file" else None
    if typo:  # a local folder named "s3" on a machine whose disk goes with it: never what was meant
        raise ConfigError(f"invalid storage URL {url!r}: did you mean {typo[1].lower()}://{url[typo.end() :]}?")
    try:
        target, extra = _BACKENDS[scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in sorted(_BACKENDS))
        raise ConfigError(f"unsupported storage URL {url!r}: use a path or one of {known}") from None
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise MissingDependencyError(
            f"{url!r} needs an optional dependency ({e.name or e}): pip install 'spotguard[{extra}]'"
        ) from e
    options = None if timeout is None else timeouts.options_for(cls, timeout)
    return cls(url) if options is None else cls(url, options)  # type: ignore[no-any-return]
