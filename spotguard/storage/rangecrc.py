"""The CRC32 of a file written by concurrent ranged downloads, kept as the ranges land.

Why: a download's check against the CRC32 S3 (or Azure's metadata) holds read the whole file again
once it was written: 0.36 s per 512 MB on our 2-core CI machine, one thread. boto3's transfer
manager writes each range in order, from one I/O thread, but ranges interleave; so this file object
keeps one running CRC per contiguous run of writes and, at the end, combines them in offset order
with ``awscrt``'s ``combine_crc32`` (no second read). A range retried from its start (boto3 reads
it again from there) drops what its first try wrote. Anything no run explains (a write inside or
across another run, a gap: e.g. a range retried after the next range had already continued its run,
or no ``awscrt`` 0.31+) gives no CRC: the caller then reads the file again, as before.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from typing import Any, BinaryIO


def _combine() -> Any:
    try:
        from awscrt.checksums import combine_crc32  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # an awscrt before 0.31, or none (boto3 installed without the aws extra)
        return None
    return combine_crc32


class RangeCrcFile:
    """A seekable write-only file object over ``f`` that keeps the CRC32 of what lands where."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._pos = 0
        # Each contiguous run of writes, by its start: the (end, CRC32 from its start) after each write.
        self._runs: dict[int, list[tuple[int, int]]] = {}
        self._bounds: dict[int, int] = {}  # every offset a write ended at (or a run starts at) -> its run
        self._starts: list[int] = []  # the runs' starts, sorted
        self._broken = False  # a write no run explains: no CRC
        self._lock = threading.Lock()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        with self._lock:
            if not self._broken:
                self._track(self._pos, data)
        self._pos += n
        return n

    def _track(self, at: int, data: Any) -> None:
        end = at + len(memoryview(data).cast("B"))
        start = self._bounds.get(at)
        if start is None:  # a new range: it must not start inside a run
            i = bisect.bisect_right(self._starts, at)
            if i and self._runs[self._starts[i - 1]][-1][0] > at:
                self._broken = True
                return
            start, self._runs[at], self._bounds[at] = at, [(at, 0)], at
            bisect.insort(self._starts, at)
        marks = self._runs[start]
        while marks[-1][0] > at:  # a range read again from a mark (the transfer's retry): what followed goes
            gone = marks.pop()[0]
            if self._bounds.get(gone) == start:
                del self._bounds[gone]
        after = bisect.bisect_right(self._starts, at)
        if marks[-1][0] != at or (after < len(self._starts) and self._starts[after] < end):
            self._broken = True  # a hole before it, or it runs over the next run's start
            return
        marks.append((end, zlib.crc32(data, marks[-1][1])))
        self._bounds.setdefault(end, start)  # reaching another run's start: that one follows; its CRC stays

    def crc(self, size: int) -> int | None:
        """The CRC32 of bytes ``0..size``, when the writes covered exactly them and ``awscrt`` can combine; else None."""
        combine = _combine()
        with self._lock:
            if self._broken or combine is None:
                return None
            total, at = 0, 0
            for start in sorted(self._runs):
                end, crc = self._runs[start][-1]
                if start != at:  # a gap, or an overlap
                    return None
                total = crc if at == 0 else combine(total, crc, end - start)
                at = end
            return total if at == size else None
