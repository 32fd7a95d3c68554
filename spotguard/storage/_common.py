"""Pieces shared by the cloud backends: URL and option checks, a checksumming spool file, temp directories."""

from __future__ import annotations

import base64
import math
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from .. import _env
from ..errors import ConfigError
from .base import check_key

Progress = Callable[[int], None]


def split_url(url: str, scheme: str) -> tuple[str, str]:
    """``scheme://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix "" or ending in /)."""
    try:
        parsed = urlparse(url)
    except ValueError as e:  # e.g. an unbalanced "[" in the host part
        raise ConfigError(f"invalid storage URL {url!r}: {e}") from None
    if parsed.scheme != scheme or not parsed.netloc or any(c.isspace() for c in parsed.netloc):
        raise ConfigError(f"invalid storage URL {url!r}: expected {scheme}://BUCKET[/PREFIX]")
    if parsed.query or parsed.fragment:
        raise ConfigError(f"invalid storage URL {url!r}: no ?query or #fragment allowed")
    prefix = parsed.path.strip("/")
    if prefix:
        check_key(prefix)
        prefix += "/"
    return parsed.netloc, prefix


def check_fields(
    options: Any,
    *,
    ints: dict[str, int | tuple[int, int]] | None = None,
    positive: tuple[str, ...] = (),
    strings: tuple[str, ...] = (),
    urls: tuple[str, ...] = (),
    kinds: dict[str, type] | None = None,
) -> None:
    """Raise ConfigError for a field of an options dataclass that is out of range or of the wrong type.

    ``ints``: field -> least value, or (least, most); ``positive``: finite numbers > 0;
    ``strings``: None or a non-empty string; ``urls``: None or an http(s):// URL with a host;
    ``kinds``: field -> the class its value must be an instance of (``retry``: ``RetryOptions``).
    """
    owner = type(options).__name__
    for name, bounds in (ints or {}).items():
        lo, hi = bounds if isinstance(bounds, tuple) else (bounds, None)
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{owner}.{name} must be an int {span}, got {value!r}")
    for name in positive:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{owner}.{name} must be a positive number, got {value!r}")
    for name in strings:
        value = getattr(options, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{owner}.{name} must be None or a non-empty string, got {value!r}")
    for name in urls:
        value = getattr(options, name)
        if value is not None and not (isinstance(value, str) and _is_http_url(value)):
            raise ConfigError(f"{owner}.{name} must be None or an http(s)://HOST[:PORT] URL, got {value!r}")
    for name, kind in (kinds or {}).items():
        value = getattr(options, name)
        if not isinstance(value, kind):
            raise ConfigError(f"{owner}.{name} must be a {kind.__name__}, got {value!r}")


def _is_http_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        return parsed.scheme in ("http", "https") and bool(parsed.hostname) and (parsed.port or 1) > 0
    except ValueError:  # a bad port or an unbalanced "["
        return False


class Crc32File:
    """A write-only wrapper that keeps a running checksum of what passes (one pass, no re-read)."""

    #: bytes between two ``on_grow`` reports (each after a flush, so that a reader of the file sees them)
    GROW_EVERY = 16 << 20

    def __init__(
        self,
        raw: BinaryIO,
        update: Callable[[Any, Any], Any] = zlib.crc32,
        on_grow: Callable[[int], None] | None = None,
    ) -> None:
        self.raw = raw
        self.crc: Any = 0
        self._update = update
        self.size = 0
        self._on_grow, self._reported = on_grow, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.crc = self._update(data, self.crc)
        self.raw.write(data)
        self.size += len(data)
        if self._on_grow is not None and self.size - self._reported >= self.GROW_EVERY:
            self.raw.flush()
            self._reported = self.size
            self._on_grow(self.size)
        return len(data)

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:  # torch.save probes this; streaming writes only
        return False

    def b64(self) -> str:
        return crc_b64(self.crc)


def parallel_part(size: int, part: int, workers: int) -> int:
    """A parallel transfer's part: about one per worker, between ``part`` and 8x it (few requests, all busy)."""
    return min(max(part, -(-size // workers)), 8 * part)


def crc_b64(crc: int) -> str:
    """The wire form S3 and GCS use for a CRC: 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def file_crc(path: Path, update: Callable[[bytes, Any], Any] = zlib.crc32) -> Any:
    """The final state of the running checksum ``update`` over the file (an int CRC by default)."""
    crc: Any = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = update(chunk, crc)
    return crc


@contextmanager
def temp_dir(parent: str | None) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="spotguard-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def tmp_parent() -> str | None:
    return _env.text(_env.TMPDIR)
