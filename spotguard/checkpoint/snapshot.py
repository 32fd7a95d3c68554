"""Host-memory snapshots of a training state into reused buffers.

A periodic checkpoint blocks the training loop only for this copy; serialising and writing happen
later in the background, from the buffers. Buffers are allocated once per tensor (pinned when
CUDA is present, so device-to-host copies run asynchronously at full PCIe speed) and reused by
every later snapshot: host memory for staging is bounded by one copy of the state. The caller
must not take a new snapshot while a previous one is still being written (at most one in flight).
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from typing import Any

import torch

_ATOMS = (int, float, bool, str, bytes, type(None))  # immutable: shared, not deep-copied


class Staging:
    """Reusable host buffers, one per tensor in the order a walk of the state meets them.

    A snapshot walks the state once, pairing the n-th tensor with the n-th buffer (reallocated when
    its shape or dtype differs: a state whose structure changed stays correct, it only allocates),
    then copies every pair in one ``torch._foreach_copy_`` call. Why: a model has thousands of small
    tensors (norms, biases, their optimizer moments), and a Python ``copy_`` and a path key per
    tensor cost several microseconds each, more than copying a small tensor.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: list[torch.Tensor] = []
        self.allocations = 0  # how many buffers were ever (re)allocated: stays flat once warm

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def snapshot(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this staging area (CPU, possibly pinned)."""
        walk = _Walk(self._buffers, self.pin)
        out = walk.copy(state)
        self._buffers = walk.buffers  # tensors that disappeared from the state lose their buffers
        self.allocations += walk.allocations
        with torch.no_grad():  # the buffers never join an autograd graph
            for non_blocking, (dst, src) in ((False, walk.plain), (True, walk.pinned)):
                if dst:
                    _copy_all(dst, src, non_blocking)
        if walk.pinned[0] and torch.cuda.is_available():
            torch.cuda.synchronize()  # non_blocking device->host copies must land before writing
        return out


class _Walk:
    """One snapshot's pass over the state: the copied structure, and the (buffer, tensor) pairs to fill."""

    def __init__(self, old: list[torch.Tensor], pin: bool) -> None:
        self.old, self.pin = old, pin
        self.buffers: list[torch.Tensor] = []
        self.allocations = 0
        self.plain: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.pinned: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.stage(obj)
        if type(obj) in _ATOMS:
            return obj
        if isinstance(obj, dict):
            items = [(k, self.copy(v)) for k, v in obj.items()]
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple)):
            items = [self.copy(v) for v in obj]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return copy.deepcopy(obj)

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor and _is_dtensor(t):  # FSDP2/TP shards: stage the local part, keep the placement
            local = self.stage(t._local_tensor)  # type: ignore[attr-defined]
            dtensor: Any = type(t)
            return dtensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]
        if t.layout is not torch.strided or t.is_quantized:
            return t.detach().to("cpu", copy=True)  # rare layouts: a plain copy, not pooled
        n = len(self.buffers)
        buf = self.old[n] if n < len(self.old) else None
        pin = self.pin and t.is_cuda
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or (self.pin and buf.is_pinned() != pin):
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self.allocations += 1
        self.buffers.append(buf)
        dst, src = self.pinned if pin else self.plain
        dst.append(buf)
        src.append(t)
        return buf


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
        items = [(canonical(k), canonical(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        items = [canonical(v) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return obj
