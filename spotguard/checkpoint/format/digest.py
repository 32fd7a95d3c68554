"""Checksums of checkpoint files: one hash per chunk, so that a resume verifies at memory speed.

A file's digest is the hash of the concatenated hashes of its ``chunk_size``-byte chunks (the last
one shorter; an empty file is one empty chunk), all with the same algorithm: the scheme of S3's
composite checksums. Chunks let a reader hash on several threads at once while the next chunks
are still coming from the disk, and writers compute the digest as the bytes stream past, so a
file is hashed once, never read back.

Algorithms (named per file in manifests of format ``spotguard/3``; see docs/checkpoints.md):

- ``blake3`` (the default): cryptographic, 2.3-5.7 GB/s per core on our CI machine against ~1 GB/s
  for SHA-256, and it releases the GIL, so the chunks of a file are hashed on every core.
- ``xxh3-128``: ~11 GB/s per core, not cryptographic (catches accidents, not a forger).
- ``sha256``: what manifests ``spotguard/1`` (whole file, ``chunk_size`` 0) and ``spotguard/2``
  (chunked) record; also the fallback when the ``blake3`` package is missing.

``SPOTGUARD_CHECKSUM`` picks the algorithm of new checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import mmap
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from spotguard import _env
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError, ConfigError

CHUNK = 16 << 20  # also fileio.BUFFER: DirectFile hashes each full buffer as one chunk
# Threads hashing one file: enough to keep up with an NVMe disk even for SHA-256 (old manifests).
# One more than the cores: a thread may wait for a page the kernel is still reading in.
HASHERS = max(2, min(8, os.cpu_count() or 1)) + 1
# Chunks read in at once ahead of the hashers: a deeper queue on the disk than one stream of faults.
READERS = 4
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python 3.11 lacks the name
ENV = _env.CHECKSUM
SHA256, BLAKE3, XXH3 = "sha256", "blake3", "xxh3-128"
ALGORITHMS = (BLAKE3, XXH3, SHA256)
HEX_LENGTH = {SHA256: 64, BLAKE3: 64, XXH3: 32}


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


def _new_sha256() -> Hasher:
    return hashlib.sha256()


def _new_blake3() -> Hasher:
    import blake3  # type: ignore[import-not-found,unused-ignore]

    return blake3.blake3()  # type: ignore[no-any-return]


def _new_xxh3() -> Hasher:
    import xxhash  # type: ignore[import-not-found,unused-ignore]

    return xxhash.xxh3_128()  # type: ignore[no-any-return]


_FACTORIES: dict[str, Callable[[], Hasher]] = {SHA256: _new_sha256, BLAKE3: _new_blake3, XXH3: _new_xxh3}
_PACKAGE = {BLAKE3: "blake3", XXH3: "xxhash"}


def hasher_factory(alg: str) -> Callable[[], Hasher]:
    """A function making new hashers of ``alg``; ``CheckpointFormatError`` when it cannot be computed here."""
    factory = _FACTORIES.get(alg)
    if factory is None:
        raise CheckpointFormatError(f"unknown checksum algorithm {alg!r} (spotguard knows {', '.join(ALGORITHMS)})")
    try:
        factory()
    except ImportError as e:
        raise CheckpointFormatError(
            f"checksum {alg} needs the {_PACKAGE[alg]} package: pip install {_PACKAGE[alg]}"
        ) from e
    return factory


def available(alg: str) -> bool:
    try:
        hasher_factory(alg)
    except CheckpointFormatError:
        return False
    return True


def default_alg() -> str:
    """The algorithm of new checkpoints: ``$SPOTGUARD_CHECKSUM``, else BLAKE3 where installed, else SHA-256."""
    wanted = _env.choices(ENV, None, _usable)
    return wanted or (BLAKE3 if available(BLAKE3) else SHA256)


def _usable(value: str) -> str:
    """``value`` as an algorithm this process can hash with; ValueError else."""
    wanted = value.lower()
    if wanted not in ALGORITHMS:
        raise ValueError(f"must be one of {', '.join(ALGORITHMS)}, got {wanted!r}")
    try:
        hasher_factory(wanted)
    except CheckpointFormatError as e:
        raise ValueError(f"{wanted}: {e}") from e
    return wanted


class ChunkedDigest:
    """Streaming digest: ``update()`` with bytes in file order, ``hexdigest()`` at the end."""

    def __init__(self, alg: str | None = None, chunk_size: int = CHUNK) -> None:
        if chunk_size <= 0:
            raise ConfigError("chunk_size must be positive")
        self.alg = alg or default_alg()
        self._new = hasher_factory(self.alg)
        self.chunk_size = chunk_size
        self._digests: list[bytes] = []
        self._hash = self._new()
        self._fill = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            k = min(len(mv), self.chunk_size - self._fill)
            self._hash.update(mv[:k])
            self._fill += k
            mv = mv[k:]
            if self._fill == self.chunk_size:
                self._digests.append(self._hash.digest())
                self._hash, self._fill = self._new(), 0

    def hexdigest(self) -> str:
        tail = [self._hash.digest()] if self._fill or not self._digests else []
        return combine(self.alg, self._digests + tail)


def combine(alg: str, digests: list[bytes]) -> str:
    """The file digest from its chunks' digests, in file order."""
    h = hasher_factory(alg)()
    h.update(b"".join(digests))
    return h.digest().hex()


def chunked_file_digest(
    path: str | Path,
    chunk_size: int = CHUNK,
    threads: int | None = None,
    alg: str = SHA256,
    progress: Callable[[int], None] | None = None,
) -> str:
    """``ChunkedDigest`` of a file, its chunks hashed on ``threads`` threads straight from a memory map.

    Why a map: a file already in the page cache is hashed where it lies, with no copy (reading it
    into buffers first halved the speed of a warm verify). Why this thread populates each chunk
    (``MADV_POPULATE_READ``, Linux 5.14+) before the pool hashes it: threads faulting in their own
    stretches of a cold file read it in small scattered pieces (~1.5x slower here), while one
    thread walking it in order keeps the kernel's readahead streaming, as fast as a plain ``read``
    loop; the pages stay in the page cache for ``torch.load(mmap=True)``. Older kernels only get
    each chunk announced (``MADV_WILLNEED``). A file cut short while it is read fails to populate:
    an ``OSError``, reported as a corrupt file; cut after its chunk was read in, or on an older kernel,
    it kills the process (SIGBUS). Only for files nothing rewrites (committed checkpoint files are
    write-once); a file some other writer may still cut short goes through ``read_file_digest``.

    ``progress(end)``: called as the walk has read the file up to ``end`` (only where it populates;
    an exception it raises stops the digest within a chunk: the chunks queued are dropped).
    """
    new = hasher_factory(alg)

    def hash_chunk(view: memoryview) -> bytes:
        try:
            h = new()
            h.update(view)
            return h.digest()
        finally:
            view.release()  # the map closes only once no view of it is left

    threads = threads or HASHERS
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return combine(alg, [hash_chunk(memoryview(b""))])
        count = -(-size // chunk_size)
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)

            def read_in(i: int) -> bool:
                return _read_in(mm, i * chunk_size, min(chunk_size, size - i * chunk_size))

            try:
                populate = hasattr(mm, "madvise") and read_in(0)  # the kernel can: then READERS chunks at once
                with (
                    ThreadPoolExecutor(min(threads, count), thread_name_prefix="spotguard-verify") as pool,
                    ThreadPoolExecutor(READERS, thread_name_prefix="spotguard-read-in") as readers,
                ):
                    futures: list[Future[bytes]] = []
                    chunks: list[memoryview] = []
                    cut: memoryview | None = None
                    reads: deque[Future[bool]] = deque()  # chunks i.. being read in, in order
                    queued = 1
                    try:
                        for i in range(count):
                            start = i * chunk_size
                            if populate:
                                while queued < min(count, i + READERS):
                                    reads.append(readers.submit(read_in, queued))
                                    queued += 1
                                if i:
                                    reads.popleft().result()
                                if progress is not None:
                                    progress(min(size, start + chunk_size))
                            cut = view[start : start + chunk_size]
                            futures.append(pool.submit(hash_chunk, cut))
                            chunks.append(cut)
                            cut = None
                    except BaseException:  # failed or stopped: what is queued is dropped, not waited for
                        for read in reads:
                            read.cancel()
                        for fut, chunk in zip(futures, chunks, strict=True):
                            if fut.cancel():  # the map closes only once no view of it is left
                                chunk.release()
                        if cut is not None:  # cut, but no task took it
                            cut.release()
                        raise
                    return combine(alg, [fut.result() for fut in futures])
            except OSError as e:
                raise CheckpointCorruptError(f"{path}: cannot read it whole ({e}): cut short?") from e
            finally:
                view.release()


def read_file_digest(path: str | Path, chunk_size: int = CHUNK, alg: str = SHA256, threads: int | None = None) -> str:
    """``chunked_file_digest`` through ``pread``, each chunk read and hashed on one of ``threads`` threads.

    For a file another writer may still cut short (a trainer's folder while its ranks save): a read
    of a truncated file returns fewer bytes, and the caller, which compares the file's size and
    modification time before trusting the digest, drops it. A page of a map cut off by a
    ``truncate`` raises SIGBUS instead, which kills the process.
    """
    new = hasher_factory(alg)
    with open(path, "rb", buffering=0) as f:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size

        def hash_chunk(offset: int) -> bytes:
            h = new()
            h.update(os.pread(fd, chunk_size, offset))
            return h.digest()

        if size <= chunk_size:  # one chunk (an empty file too): no pool
            return combine(alg, [hash_chunk(0)])
        offsets = range(0, size, chunk_size)
        with ThreadPoolExecutor(min(threads or HASHERS, len(offsets)), thread_name_prefix="spotguard-read") as pool:
            return combine(alg, list(pool.map(hash_chunk, offsets)))


def _read_in(mm: mmap.mmap, start: int, length: int) -> bool:
    """Read ``length`` bytes at ``start`` into the map now; False when the kernel cannot (before 5.14:
    the chunk is only announced, and later ones are left to the faults of the hashing threads).

    Through ``ctypes`` where it can: ``mmap.madvise`` holds the GIL while the kernel reads, and a cold
    walk then starved every other thread of the process (a resume's ``torch.load`` waited for the
    whole walk, its upload behind it: no overlap at all).
    """
    begin = start - start % mmap.PAGESIZE
    n = length + start - begin
    address = _address(mm)
    try:
        if address is None:
            mm.madvise(MADV_POPULATE_READ, begin, n)
        elif _libc().madvise(address + begin, n, MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    if hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED, begin, n)
    return False


def _address(mm: mmap.mmap) -> int | None:
    """Where ``mm``'s bytes start in memory (None without NumPy); valid while ``mm`` is open."""
    try:
        import numpy as np
    except ImportError:
        return None
    view = np.frombuffer(mm, dtype=np.uint8)  # a read-only map: ctypes' from_buffer wants a writable one
    address = int(view.ctypes.data)
    del view  # a buffer export left behind would keep the map from closing
    return address


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call lets go of the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def sha256_file(path: str | Path) -> str:
    """Whole-file SHA-256 (manifests of format spotguard/1)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_digest(
    path: str | Path, chunk_size: int, alg: str = SHA256, progress: Callable[[int], None] | None = None
) -> str:
    """The digest a manifest entry records: chunked when ``chunk_size`` > 0, else whole-file SHA-256."""
    return chunked_file_digest(path, chunk_size, alg=alg, progress=progress) if chunk_size else sha256_file(path)
