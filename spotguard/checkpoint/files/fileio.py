"""A write-once checkpoint file that bypasses the page cache and hashes its bytes as they pass.

Why: writing a GiB through the page cache costs the kernel seconds of CPU (it allocates and
copies every page; ~2.5 s of system time per GiB on our 2-core CI machine, against 0.05 s with
O_DIRECT), and that CPU is taken from the training loop while a periodic save runs in the
background. Reading the file back to hash it costs as much again. ``DirectFile`` copies what it is
given into two page-aligned buffers (large writes with the GIL released), writes each full
buffer with ``O_DIRECT`` from a helper thread while the other one fills (the GIL is released
during the write), and hashes each buffer
on a second helper thread during its write (one chunk of ``digest.ChunkedDigest`` per buffer;
BLAKE3 and ``hashlib`` release the GIL as well), so the file is written once, never read back, and
the hash adds nothing to the time a buffer takes unless it is slower than the disk. Where the
filesystem refuses
``O_DIRECT`` (tmpfs, some FUSE mounts) or the platform has none (macOS), it writes through the page
cache instead; ``close()`` always fsyncs.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from spotguard.checkpoint.files.runqueue import WaitClock
from spotguard.checkpoint.format.digest import CHUNK, ChunkedDigest
from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.errors import ConfigError, SaveCancelled

O_DIRECT = getattr(os, "O_DIRECT", 0)
ALIGN = 4096  # O_DIRECT offsets and lengths: a multiple of the device's logical block size
BUFFER = CHUNK  # a whole number of checksum chunks per buffer
_NUMPY_FROM = 64 << 10  # smaller writes (pickle frames, zip headers) are copied faster without numpy


@dataclass
class WorkMeter:
    """The summed ``DirectFile.work_seconds`` of a save's files (``layout.write(meter=)``)."""

    seconds: float = 0.0


class DirectFile:
    """``open(path, "wb")`` for one large, sequentially written file, with its size and checksum."""

    def __init__(
        self,
        path: str | Path,
        buffer_size: int = BUFFER,
        direct: bool = True,
        crc: Callable[[Any, Any], Any] | None = None,
        cancel: threading.Event | None = None,
        on_grow: Callable[[int], None] | None = None,
    ) -> None:
        """``cancel``: once set, the next full buffer raises ``SaveCancelled`` instead of being written, so an
        abandoned save gives the disk up within one buffer, not at the end of its file. ``on_grow``: called
        from a helper thread with the bytes on disk and hashed so far, after each buffer (a streamed upload reads them).
        ``crc``: also keep this running checksum (``zlib.crc32``-style, the storage's ``upload_crc``:
        a CRC, or Azure's per-block digests) in the same pass, for the service that receives the file to
        check it against (``self.crc``, its final state)."""
        if buffer_size <= 0 or buffer_size % ALIGN:
            raise ConfigError(f"buffer_size must be a positive multiple of {ALIGN}")
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(direct and O_DIRECT)
        try:
            self._fd = os.open(path, flags | (O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            self.direct = False
            self._fd = os.open(path, flags, 0o644)
        self.size = 0
        self._hash_state = ChunkedDigest()  # updated by the hashing thread only, in file order
        self.chunk_size = self._hash_state.chunk_size
        self.alg = self._hash_state.alg
        self._crc_update = crc
        self._cancel = cancel
        self._on_grow = on_grow
        self._written = self._hashed = 0  # bytes of the file written, and hashed (its CRC kept): on_grow gets the least
        self._grow_lock = threading.Lock()
        self.crc: Any = 0 if crc is not None else None
        self._buffers = [mmap.mmap(-1, buffer_size) for _ in range(2)]  # page-aligned
        self._views = [memoryview(b) for b in self._buffers]
        # numpy here, not at the top: the CLI imports this module for its readers (numpy is ~0.2 s of its start)
        import numpy as np

        self._arrays = [np.frombuffer(b, np.uint8) for b in self._buffers]  # the same memory, for write()
        self._current, self._fill = 0, 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="spotguard-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="spotguard-hash")
        self._inflight: list[Future[None]] = []  # the write and the hash of the buffer last submitted
        self.closed = False
        #: Seconds spent in the disk's system calls (write, fsync), and CPU seconds spent hashing: with the
        #: producer's CPU time, what the file costs apart from waiting for a CPU (``work_seconds``)
        self.io_s = 0.0
        self.hash_s = 0.0
        #: Of ``io_s``, the seconds its thread waited for a CPU once the disk was done (``runqueue``)
        self.cpu_wait = WaitClock()

    # -- the file-object surface torch.save and shutil use ----------------------------------------
    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        mv = memoryview(data).cast("B")
        n, off = len(mv), 0
        # Large writes (tensor records) are copied by numpy, which releases the GIL: a memoryview
        # slice assignment holds it (py-spy: ~0.8 s per GiB on our loaded CI machine) while the
        # training loop's thread waits to run its next op. Small ones (pickle frames, zip headers)
        # are faster without numpy.
        large = n >= _NUMPY_FROM
        src: Any = mv
        if large:
            import numpy as np  # imported by __init__ already: a lookup

            src = np.frombuffer(mv, np.uint8)
        while off < n:
            dst: Any = self._arrays[self._current] if large else self._views[self._current]
            k = min(n - off, len(dst) - self._fill)
            dst[self._fill : self._fill + k] = src[off : off + k]
            self._fill += k
            off += k
            if self._fill == len(dst):
                self._submit(len(dst))
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing to do: bytes reach the disk in whole buffers, and all of them on ``close()``."""

    def hexdigest(self) -> str:
        """The file's ``ChunkedDigest``, once closed."""
        return self._hash_state.hexdigest()

    def entry(self, name: str) -> FileEntry:
        """The manifest entry of this file, stored as ``name``, once closed."""
        return FileEntry(name, self.size, self.hexdigest(), self.chunk_size, self.alg)

    def close(self) -> None:
        """Write what is buffered, cut the block padding off, fsync. Raises the first write error."""
        if self.closed:
            return
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN if self.direct else self._fill
                self._views[self._current][self._fill : padded] = bytes(padded - self._fill)
                self._submit(padded, self._fill)
            self._wait()
            t0, w0 = time.perf_counter(), self.cpu_wait.start()
            os.ftruncate(self._fd, self.size)  # drop the O_DIRECT block padding
            os.fsync(self._fd)
            self.cpu_wait.stop(w0)  # inside the timed span: the wait never exceeds it
            self.io_s += time.perf_counter() - t0
        finally:
            self._release()

    def work_seconds(self, produce_cpu_s: float) -> float:
        """How long this file would have taken with a CPU to itself: the slowest of its three overlapped
        parts (the producer's CPU seconds, given; the disk's time, less what its thread then waited for a
        CPU; the hash's CPU seconds). A niced background writer's wall time also counts the time it waited
        for the training loop's CPU and GIL, which an emergency save on a stopped loop does not (the
        emergency estimate's rate)."""
        return max(produce_cpu_s, self.io_s - self.cpu_wait.seconds, self.hash_s)

    def abort(self) -> None:
        """Close without flushing (the caller deletes the file)."""
        if not self.closed:
            try:
                self._wait()
            except OSError:
                pass
            finally:
                self._release()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ---------------------------------------------------------------------------------
    def _submit(self, length: int, data: int | None = None) -> None:
        """Write the buffer's first ``length`` bytes on the I/O thread while the hashing thread hashes
        its first ``data`` (default: all): the hash is off the write's critical path."""
        self._wait()  # the other buffer's write and hash must be done before it is refilled
        if self._cancel is not None and self._cancel.is_set():
            raise SaveCancelled("save abandoned while writing a file")
        view = self._views[self._current]
        self._inflight = [
            self._io.submit(self._write_all, view[:length], length if data is None else data),
            self._hasher.submit(self._hash, view[: length if data is None else data]),
        ]
        self._current, self._fill = 1 - self._current, 0

    def _wait(self) -> None:
        inflight, self._inflight = self._inflight, []
        errors = []
        for fut in inflight:  # both, even when one failed: the buffer is free only then
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, the first one
                errors.append(e)
        if errors:
            raise errors[0]

    def _hash(self, data: memoryview) -> None:
        """On the hashing thread, buffer after buffer in file order."""
        t0 = time.thread_time()
        self._hash_state.update(data)
        if self._crc_update is not None:
            self.crc = self._crc_update(data, self.crc)
        self.hash_s += time.thread_time() - t0
        self._grew(hashed=len(data))

    def _grew(self, written: int = 0, hashed: int = 0) -> None:
        """Report the bytes both on disk and in the running checksums (``crc``'s digest of a block is then
        known to a streamed upload that sends it), from whichever helper thread finishes a buffer last."""
        if self._on_grow is None:
            return
        with self._grow_lock:
            before = min(self._written, self._hashed)
            self._written += written
            self._hashed += hashed
            now = min(self._written, self._hashed)
            if now > before:
                self._on_grow(now)

    def _write_all(self, view: memoryview, data: int = 0) -> None:
        """Write ``view`` whole (``data`` of its bytes are the file's, the rest O_DIRECT padding)."""
        t0, w0 = time.perf_counter(), self.cpu_wait.start()
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                # The filesystem accepted O_DIRECT at open but refuses these writes: go buffered.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
                continue
            view = view[n:]
        self.cpu_wait.stop(w0)  # inside the timed span: the wait never exceeds it
        self.io_s += time.perf_counter() - t0
        self._grew(written=data)

    def _release(self) -> None:
        self.closed = True
        self._io.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        # freed with their last reference (an error's traceback may hold one)
        self._views, self._arrays, self._buffers = [], [], []
        os.close(self._fd)
