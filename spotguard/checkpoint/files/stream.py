"""``torch.save`` whose tensor bytes are fed to the file in a pipeline, from the device or from host memory.

Why: ``torch.save`` of a state on a GPU copies each storage to fresh pageable memory and writes it,
one storage after another, the disk idle during every copy and the whole copy held in memory.
An emergency save has the deadline's clock running through all of that.

How: ``torch.serialization.skip_data`` makes ``torch.save`` write the pickle and every record's
header as usual but *skip* each storage's bytes, with a relative ``seek``. ``StreamFile`` turns
each such seek into the storage's bytes: storages are met in the order torch numbers them (the
order of first appearance while pickling, found by a pickling pass of our own), host storages are
written straight from their memory, and device storages go through a ``Ring`` of a few host
buffers (pinned with CUDA): the device-to-host copy of chunk k+1 runs on a side stream while
chunk k is written. The file is byte for byte what ``serialize.save`` writes (tested), so it loads
with ``torch.load(weights_only=True)`` and an unchanged state still gives the same checksum.
Host memory held: the ring's buffers (``Ring.nbytes``), whatever the state's size.
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch

from spotguard.checkpoint.files import serialize
from spotguard.errors import SaveCancelled

logger = logging.getLogger(__name__)

CHUNK = 64 << 20  # bytes per ring buffer: large copies and writes, few of them
SLOTS = 4  # buffers in the ring: a copy, a write, and room for the device to run ahead


def storage_order(obj: Any) -> list[torch.UntypedStorage] | None:
    """The storages ``torch.save(obj)`` writes, in its order (zero-byte ones have no record body).

    None where ``skip_data`` cannot save ``obj`` (quantized or nested tensors): the plain path then."""
    found: list[torch.UntypedStorage] = []
    seen: set[int] = set()

    class _Order(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                s = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                key = s._cdata
                if key not in seen:
                    seen.add(key)
                    if s.nbytes():
                        found.append(s)
                return "s"
            return None

    try:
        with torch.serialization.skip_data():  # the same reductions torch's own pass makes
            _Order(io.BytesIO(), protocol=2).dump(obj)
    except RuntimeError as e:  # "Cannot serialize ... under skip_data": not a streaming state
        logger.debug("state not streamed (%s); plain torch.save", e)
        return None
    return found


class Ring:
    """A few reused host buffers that carry device storages to a file, chunk by chunk, copying ahead.

    ``begin(storages)`` plans every chunk of the save in file order; each ``write(storage)`` then
    writes that storage's chunks while the copies of the next chunks, of this storage or the next
    ones, run into the free buffers: the pipeline does not drain at a storage's end. ``copy_host``:
    host storages go through the buffers too (tests: the pipeline needs no device); by default they
    are written from their own memory, with no copy at all.
    """

    def __init__(self, chunk: int = CHUNK, slots: int = SLOTS, pin: bool | None = None, copy_host: bool = False):
        if chunk <= 0 or slots < 2:
            raise ValueError("a ring needs chunk > 0 and at least 2 slots")
        self.chunk, self.slots, self.copy_host = chunk, slots, copy_host
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: list[torch.Tensor] = []
        self._stream: Any = None
        self._plan: deque[tuple[int, torch.Tensor, int, int]] = deque()  # (storage, its bytes, offset, length)
        self._inflight: deque[tuple[int, int, int, Any]] = deque()  # (storage, slot, length, event)
        self._free: list[int] = []
        self.copied = 0  # bytes that went through the buffers (what the tests check)

    @classmethod
    def within(cls, budget: int) -> Ring:
        """The default ring, its chunks made smaller where ``SLOTS`` of them would exceed ``budget`` bytes."""
        chunk = min(CHUNK, max(budget // SLOTS // 4096 * 4096, 1 << 20))
        return cls(chunk=chunk, slots=SLOTS)

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.numel() for b in self._buffers)

    def _through(self, storage: torch.UntypedStorage) -> bool:
        return self.copy_host or storage.device.type != "cpu"

    def begin(self, storages: list[torch.UntypedStorage]) -> None:
        """Plan the chunks of ``storages`` (a save's, in file order) and start the first copies."""
        self._plan.clear()
        self._inflight.clear()
        self._free = list(range(self.slots))
        cuda = None
        for i, s in enumerate(storages):
            if self._through(s):
                flat = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
                cuda = cuda or (flat.device if flat.is_cuda else None)
                self._plan.extend(
                    (i, flat, off, min(self.chunk, flat.numel() - off)) for off in range(0, flat.numel(), self.chunk)
                )
        if cuda is not None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=cuda)
            self._stream.wait_stream(torch.cuda.current_stream(cuda))  # the loop's last writes first
        self._fill()

    def _fill(self) -> None:
        """Copy the next planned chunks into the free buffers (asynchronously from a device)."""
        while self._free and self._plan:
            i, flat, off, n = self._plan.popleft()
            slot = self._free.pop()
            while len(self._buffers) <= slot:
                self._buffers.append(torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.pin))
            buf = self._buffers[slot][:n]
            event = None
            if flat.is_cuda:
                with torch.cuda.stream(self._stream):
                    buf.copy_(flat[off : off + n], non_blocking=self.pin)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            else:
                buf.copy_(flat[off : off + n])
            self._inflight.append((i, slot, n, event))
            self.copied += n

    def write(self, index: int, storage: torch.UntypedStorage, out: IO[bytes]) -> None:
        """Write the ``index``-th storage of ``begin``'s list to ``out``."""
        if not self._through(storage):
            out.write(torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data)
            return
        left = storage.nbytes()
        while left:
            if not self._inflight or self._inflight[0][0] != index:
                raise RuntimeError(f"storage {index} was not planned in this order while streaming a checkpoint")
            _, slot, n, event = self._inflight.popleft()
            if event is not None:
                event.synchronize()
            out.write(self._buffers[slot][:n].numpy().data)  # copied out: the buffer is free again
            self._free.append(slot)
            self._fill()
            left -= n


class StreamFile:
    """The file object ``torch.save`` writes to under ``skip_data``: its seeks become storage bytes."""

    def __init__(self, out: IO[bytes], storages: list[torch.UntypedStorage], ring: Ring) -> None:
        self._out, self._ring = out, ring
        self._storages = storages
        self._next = 0
        self._pos = 0
        ring.begin(storages)

    def write(self, data: Any) -> int:
        n = self._out.write(data)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        i = self._next
        if whence != io.SEEK_CUR or i >= len(self._storages) or self._storages[i].nbytes() != offset:
            raise RuntimeError(f"unexpected seek({offset}, {whence}) while streaming a checkpoint")
        self._ring.write(i, self._storages[i], self._out)
        self._next += 1
        self._pos += offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._out.flush()

    def writable(self) -> bool:
        return True

    def check_done(self) -> None:
        left = len(self._storages) - self._next
        if left:
            raise RuntimeError(f"{left} storage(s) were never written while streaming a checkpoint")


@contextmanager
def pinned_torch_save() -> Iterator[None]:
    """Inside the block, ``torch.save`` copies device storages through pinned host memory (torch's own
    setting, ``torch.utils.serialization.config.save.use_pinned_memory_for_d2h``; a no-op without CUDA
    or on a torch without it): a trainer's own save, which spotguard does not write, then copies at
    the bus's speed instead of through pageable memory. The setting is restored after."""
    try:  # imported by name: `import torch` leaves it out until the first torch.save (seen on torch 2.11)
        config = importlib.import_module("torch.utils.serialization.config").save
    except (ImportError, AttributeError):
        config = None
    if config is None or not hasattr(config, "use_pinned_memory_for_d2h") or not torch.cuda.is_available():
        yield
        return
    before = config.use_pinned_memory_for_d2h
    config.use_pinned_memory_for_d2h = True
    try:
        yield
    finally:
        config.use_pinned_memory_for_d2h = before


def save(obj: Any, f: IO[bytes], ring: Ring | None = None) -> None:
    """``serialize.save(obj, f)`` (the same bytes), storages fed through ``ring``: see the module's docstring."""
    storages = storage_order(obj) if hasattr(torch.serialization, "skip_data") else None
    try:
        if storages is None:
            serialize.save(obj, f)
            return
        stream = StreamFile(f, storages, ring or Ring())
        with torch.serialization.skip_data():
            serialize.save(obj, stream)  # type: ignore[arg-type]
    except Exception as e:
        # A save cancelled inside torch's writer comes out as the writer's own error about it (its zip
        # trailer cannot be written any more): the cancel is what happened, and what callers act on.
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, SaveCancelled):
            cause = cause.__cause__ or cause.__context__
        if cause is not None and cause is not e:
            raise SaveCancelled(str(cause)) from e
        raise
    stream.check_done()
