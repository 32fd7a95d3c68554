"""Large GCS uploads: parts in parallel as temporary objects, then composed into one, CRC32C-checked.

From a finished file (``file_parts``), or from a file still being written (``growing_parts``: each
part is read once it has landed, so the upload overlaps the write). GCS composes at most 32 objects
per request: more parts are composed in rounds, 32 at a time. Each part carries its own CRC32C; the
composed object's CRC32C (computed by GCS) must equal the writer's CRC32C of the whole file, so a
part mixed up, or damaged on the local disk after it was written, cannot go unnoticed: the object is
deleted and the upload fails. The parts are deleted in every case (``NAME.sg-part-TOKEN-NN``, what
``GCSStorage.leftovers`` finds when a killed upload could not).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import StorageError
from ._common import Progress

if TYPE_CHECKING:
    from .growing import GrowingFile


class Composer(Protocol):
    """What a composite upload needs of ``GCSStorage`` (typed here, so this module never imports it back)."""

    @property
    def prefix(self) -> str: ...

    @property
    def progress(self) -> Progress | None: ...

    @property
    def bucket(self) -> Any: ...

    @property
    def options(self) -> Any: ...

    def _key(self, key: str) -> str: ...

    def _call(self, what: str, key: str, fn: Callable[[], Any], deadline: float | None = None) -> Any: ...

    def _timeout(self, deadline: float | None) -> float: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def describe(self, key: str = "") -> str: ...


logger = logging.getLogger(__name__)

PART_MARK = ".sg-part-"  # temporary parts of a composite upload; invisible to list()
FAN_IN = 32  # objects per compose request (GCS's limit)


def file_parts(path: Path, size: int, part: int) -> Iterator[Callable[[], bytes]]:
    """Readers of the parts of a finished file."""
    for start in range(0, size, part):
        yield functools.partial(_pread, path, start, min(part, size - start))


def growing_parts(growing: GrowingFile, part: int) -> Iterator[Callable[[], bytes]]:
    """Readers of the parts of a file being written: a part exists once its first byte has landed, and
    its reader waits for the whole of it (or the end of the file)."""

    def read(start: int) -> bytes:
        return _pread(growing.path, start, growing.wait_for(start + part) - start)

    start = 0
    while growing.wait_for(start + 1) > start:
        yield functools.partial(read, start)
        start += part


def _pread(path: Path, start: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = os.pread(fd, n, start)
    finally:
        os.close(fd)
    if len(data) != n:
        raise StorageError(f"{path.name}: read {len(data)} bytes at {start}, expected {n}: the file was cut")
    return data


def upload(
    st: Composer, key: str, parts: Iterable[Callable[[], bytes]], crc: Callable[[], Any], deadline: float | None
) -> None:
    """Upload ``parts`` (readers, in order) as ``key``; ``crc()``: the writer's base64 CRC32C of the whole
    file, asked once every part is read (a growing file knows it only at its end)."""
    full = st._key(key)
    token = secrets.token_hex(6)
    names: list[str] = []

    def send(name: str, read: Callable[[], bytes]) -> None:
        data = read()
        st._call(
            "upload part of",
            key,
            lambda: st.bucket.blob(name).upload_from_string(
                data, checksum="crc32c", retry=None, timeout=st._timeout(deadline)
            ),
            deadline,
        )
        if st.progress:
            st.progress(len(data))

    def name() -> str:
        names.append(f"{full}{PART_MARK}{token}-{len(names):02d}")
        return names[-1]

    try:
        with ThreadPoolExecutor(st.options.concurrency, thread_name_prefix="spotguard-gcs") as pool:
            sent: list[Future[None]] = [pool.submit(send, name(), read) for read in parts]
            for fut in sent:
                fut.result()
        level = list(names)
        while len(level) > FAN_IN:  # compose in rounds of 32
            level = [
                _compose(st, key, name(), level[i : i + FAN_IN], deadline).name for i in range(0, len(level), FAN_IN)
            ]
        want = crc()
        dest = _compose(st, key, full, level, deadline)
        if dest.crc32c and dest.crc32c != want:
            st.delete([key])
            raise StorageError(f"composed {st.describe(key)} has CRC32C {dest.crc32c}, the file {want}: deleted")
    finally:
        try:
            st.delete([n[len(st.prefix) :] for n in names])
        except StorageError as e:
            logger.warning("could not delete temporary parts of %s: %s", st.describe(key), e)


def _compose(st: Composer, key: str, dest: str, sources: list[str], deadline: float | None) -> Any:
    """Compose ``sources`` (full names) into ``dest``; the blob, with the properties GCS returned (its CRC32C)."""
    blob = st.bucket.blob(dest)
    st._call(
        "compose",
        key,
        lambda: blob.compose([st.bucket.blob(n) for n in sources], retry=None, timeout=st._timeout(deadline)),
        deadline,
    )
    return blob
