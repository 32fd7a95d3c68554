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


class Staging:
    """Reusable host buffers, keyed by each tensor's position in the state."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # how many buffers were ever (re)allocated: stays flat once warm

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def snapshot(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this staging area (CPU, possibly pinned)."""
        seen: set[str] = set()
        out = self._copy(state, "", seen)
        for key in set(self._buffers) - seen:  # tensors that disappeared from the state
            del self._buffers[key]
        if any(b.is_pinned() for b in self._buffers.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()  # non_blocking device->host copies must land before writing
        return out

    def _copy(self, obj: Any, path: str, seen: set[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._stage(obj, path)
        if isinstance(obj, dict):
            items = [(k, self._copy(v, f"{path}/{k}", seen)) for k, v in obj.items()]
            return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", seen) for i, v in enumerate(obj)]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return copy.deepcopy(obj)

    def _stage(self, t: torch.Tensor, path: str) -> torch.Tensor:
        t = t.detach()
        if _is_dtensor(t):  # FSDP2/TP shards: stage this rank's local part, keep its placement
            local = self._stage(t._local_tensor, path)  # type: ignore[attr-defined]
            dtensor: Any = type(t)
            return dtensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]
        if t.layout is not torch.strided or t.is_quantized:
            return t.to("cpu", copy=True)  # rare layouts: a plain copy, not pooled
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin and t.is_cuda)
            self._buffers[path] = buf
            self.allocations += 1
        buf.copy_(t, non_blocking=buf.is_pinned())
        return buf


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
