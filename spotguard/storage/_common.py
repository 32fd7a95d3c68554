"""Pieces shared by the cloud backends: URL parsing, a checksumming spool file, temp directories."""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from ..errors import ConfigError
from .base import check_key

Progress = Callable[[int], None]


def split_url(url: str, scheme: str) -> tuple[str, str]:
    """``scheme://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix "" or ending in /)."""
    parsed = urlparse(url)
    if parsed.scheme != scheme or not parsed.netloc:
        raise ConfigError(f"invalid storage URL {url!r}: expected {scheme}://BUCKET[/PREFIX]")
    if parsed.query or parsed.fragment:
        raise ConfigError(f"invalid storage URL {url!r}: no ?query or #fragment allowed")
    prefix = parsed.path.strip("/")
    if prefix:
        check_key(prefix)
        prefix += "/"
    return parsed.netloc, prefix


class Crc32File:
    """A write-only wrapper that keeps a running checksum of what passes (one pass, no re-read)."""

    def __init__(self, raw: BinaryIO, update: Callable[[Any, int], int] = zlib.crc32) -> None:
        self.raw = raw
        self.crc = 0
        self._update = update
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.crc = self._update(data, self.crc)
        self.raw.write(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:  # torch.save probes this; streaming writes only
        return False

    def b64(self) -> str:
        return crc_b64(self.crc)


def crc_b64(crc: int) -> str:
    """The wire form S3 and GCS use for a CRC: 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def file_crc(path: Path, update: Callable[[bytes, int], int] = zlib.crc32) -> int:
    crc = 0
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
    return os.environ.get("SPOTGUARD_TMPDIR") or None
