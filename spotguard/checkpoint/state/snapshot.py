"""Host-memory snapshots of a training state into reused buffers.

A periodic checkpoint blocks the training loop only for this copy; serialising and writing happen
later in the background, from the buffers. Buffers are allocated once per tensor (pinned when
CUDA is present, so device-to-host copies run asynchronously at full PCIe speed) and reused by
every later snapshot: host memory for staging is bounded by one copy of the state. The caller
must not take a new snapshot while a previous one is still being written (at most one in flight).
"""

from __future__ import annotations

import copy as copy_module
import logging
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from spotguard.checkpoint.state.slabs import Need, carve

logger = logging.getLogger(__name__)
_ATOMS = (int, float, bool, str, bytes, type(None))  # immutable: shared, not deep-copied
_SCALARS = (int, float, bool, type(None))  # what canonical() returns as it is, without a call
_Tensor = torch.Tensor
_STRIDED = torch.strided
_intern = sys.intern


class Staging:
    """Reusable host buffers, one per tensor in the order a walk of the state meets them.

    A snapshot walks the state once, pairing the n-th tensor with the n-th buffer (reallocated when
    its shape or dtype differs: a state whose structure changed stays correct, it only allocates),
    then copies every pair in one ``torch._foreach_copy_`` call. The same walk gives the copy the
    form ``canonical()`` would (fresh containers, interned strings), so that a staged state needs no
    second pass to serialise to the same bytes. Why: a model has thousands of small tensors (norms,
    biases, their optimizer moments), and every Python step per tensor (a ``copy_``, an attribute
    read, a function call) costs about as much as copying a small tensor.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: list[_Buffer] = []
        self.allocations = 0  # how many buffers were ever (re)allocated: stays flat once warm
        self.alloc_s = 0.0  # seconds the last snapshot spent allocating or waiting for ``reserve`` (0 once warm)
        self._nbytes = 0
        self._reserving: threading.Thread | None = None
        self._reserved: list[_Buffer] = []

    def reserve(self, state: Any) -> None:
        """Allocate the buffers a snapshot of ``state`` will need on a helper thread, in a few slabs
        (``slabs``), so that the first snapshot finds them ready. Only when cold. ``state`` is walked
        here, on the caller's thread (the loop's: nothing else reads the live state)."""
        if self._buffers or self._reserving is not None:
            return
        plan = _Plan(self.pin)
        plan.copy(state)
        needs = plan.needs

        def run() -> None:
            try:
                self._reserved = [
                    _Buffer(t, n.shape, n.dtype, n.pinned) for t, n in zip(carve(needs), needs, strict=True)
                ]
            except Exception as e:  # e.g. pinned memory refused: the first snapshot allocates as it would have
                logger.warning("cannot reserve the checkpoint staging in the background (%s: %s)", type(e).__name__, e)

        self._reserving = threading.Thread(target=run, name="spotguard-staging", daemon=True)
        self._reserving.start()

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (read after every snapshot: kept, not summed per tensor)."""
        return self._nbytes

    def snapshot(self, state: Any) -> Any:
        """A canonical copy of ``state`` whose tensors live in this staging area (CPU, possibly pinned)."""
        waited, fresh = 0.0, False
        if self._reserving is not None:  # the buffers ``reserve`` is allocating: wait for them
            t0 = time.perf_counter()
            self._reserving.join()
            waited = time.perf_counter() - t0
            self._reserving, fresh = None, not self._buffers
            if fresh:
                self._buffers = self._reserved
            self._reserved = []
        walk = _Walk(self._buffers, self.pin)
        out = walk.copy(state)
        if fresh or walk.allocations or len(walk.buffers) != len(self._buffers):
            self._nbytes = sum(b.tensor.numel() * b.tensor.element_size() for b in walk.buffers)
        self._buffers = walk.buffers  # tensors that disappeared from the state lose their buffers
        self.allocations += walk.allocations
        self.alloc_s = walk.alloc_s + waited
        with torch.no_grad():  # the buffers never join an autograd graph
            for non_blocking, (dst, src) in ((False, walk.plain), (True, walk.pinned)):
                if dst:
                    _copy_all(dst, src, non_blocking)
        if walk.pinned[0] and torch.cuda.is_available():
            torch.cuda.synchronize()  # non_blocking device->host copies must land before writing
        return out


class _Buffer(NamedTuple):
    """A staging buffer and what it fits, read once when it was made (a tensor's attributes are slow)."""

    tensor: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    pinned: bool


class _Walk:
    """One snapshot's pass over the state: the copied canonical structure, and the (buffer, tensor)
    pairs to fill. The hot paths (a plain tensor, a str key) are tested inline, not by a call."""

    def __init__(self, old: list[_Buffer], pin: bool) -> None:
        self.old, self.pin = old, pin
        self.buffers: list[_Buffer] = []
        self.allocations = 0
        self.alloc_s = 0.0
        self.plain: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.pinned: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def copy(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _Tensor or isinstance(obj, _Tensor):
            return self.stage(obj)
        if kind is str:
            return _intern(obj)
        if kind in _ATOMS:
            return obj
        copy, stage = self.copy, self.stage
        if isinstance(obj, dict):
            items = [
                (
                    _intern(k) if type(k) is str else k if type(k) is int else canonical(k),
                    stage(v) if type(v) is _Tensor else copy(v),
                )
                for k, v in obj.items()
            ]
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple)):
            values = [stage(v) if type(v) is _Tensor else copy(v) for v in obj]
            return kind(values) if not hasattr(obj, "_fields") else kind(*values)
        return canonical(copy_module.deepcopy(obj))

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not _Tensor and _is_dtensor(t):  # FSDP2/TP shards: stage the local part, keep the placement
            local = self.stage(t._local_tensor)  # type: ignore[attr-defined]
            dtensor: Any = type(t)
            return dtensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]
        if t.layout is not _STRIDED:
            return t.detach().to("cpu", copy=True)  # rare layouts: a plain copy, not pooled
        n = len(self.buffers)
        pin = self.pin and t.is_cuda
        buf: _Buffer | None = self.old[n] if n < len(self.old) else None
        # A quantized tensor never matches a buffer: its dtype (qint8 ...) is never a buffer's.
        if buf is None or buf.dtype is not t.dtype or buf.shape != t.shape or (self.pin and buf.pinned != pin):
            buf = self.allocate(t, pin)
        if buf is None:
            return t.detach().to("cpu", copy=True)  # quantized: a plain copy, not pooled
        self.buffers.append(buf)
        dst, src = self.pinned if pin else self.plain
        dst.append(buf.tensor)
        src.append(t)
        return buf.tensor

    def allocate(self, t: torch.Tensor, pin: bool) -> _Buffer | None:
        if t.is_quantized:
            return None
        self.allocations += 1
        shape = t.shape
        t0 = time.perf_counter()
        buf = _Buffer(torch.empty(shape, dtype=t.dtype, device="cpu", pin_memory=pin), shape, t.dtype, pin)
        self.alloc_s += time.perf_counter() - t0
        return buf


class _Plan(_Walk):
    """A walk that only lists the buffers a snapshot would pair with the state's tensors, in its order."""

    def __init__(self, pin: bool) -> None:
        super().__init__([], pin)
        self.needs: list[Need] = []

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not _Tensor and _is_dtensor(t):
            return self.stage(t._local_tensor)  # type: ignore[attr-defined]
        if t.layout is _STRIDED and not t.is_quantized:
            self.needs.append(Need(t.shape, t.dtype, self.pin and t.is_cuda))
        return t


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src, non_blocking=non_blocking)
    else:  # pragma: no cover - torch without foreach kernels
        for d, t in zip(dst, src, strict=True):
            d.copy_(t, non_blocking=non_blocking)


def _is_dtensor(t: torch.Tensor) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (checked without importing it where it was never used)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor") and hasattr(t, "_spec")


def canonical(obj: Any) -> Any:
    """``obj`` with fresh containers and interned strings, tensors untouched.

    ``pickle`` memoises by object identity, so one state can serialise to different bytes depending
    on which equal strings happen to be the same object (a key made by the optimizer, or loaded
    from a checkpoint). Canonical, the same state gives the same bytes, and the same SHA-256.
    """
    if type(obj) is str:  # sys.intern refuses subclasses (str enums): those stay as they are
        return sys.intern(obj)
    if isinstance(obj, dict):
        items = [(canonical(k), v if type(v) in _SCALARS else canonical(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        values = [v if type(v) in _SCALARS else canonical(v) for v in obj]
        return type(obj)(values) if not hasattr(obj, "_fields") else type(obj)(*values)
    return obj


class HoldsStaging:
    """What an engine that stages into a ``Staging`` (``_staging``) reports of it (both engines)."""

    _staging: Staging

    @property
    def staged_bytes(self) -> int:
        """Bytes held in the reused host buffers of staged saves."""
        return self._staging.nbytes

    @property
    def alloc_s(self) -> float:
        """Seconds the last snapshot spent allocating staging buffers (not the loop's steady cost)."""
        return self._staging.alloc_s
