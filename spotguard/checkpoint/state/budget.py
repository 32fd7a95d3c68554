"""How much host memory a periodic snapshot may hold, and whether a state fits.

Why: a snapshot doubles the state in host memory (pinned, with CUDA, where the kernel cannot page
it out). A state larger than what the machine can spare would fail to pin or push the job into
swap; past the budget a periodic save is written synchronously instead, streamed through a small
ring of buffers (``stream.Ring``), at the disk's speed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHARE = 0.5  # of the memory available when first asked: the default budget


def available_memory() -> int | None:
    """Bytes of memory this machine can give without swapping (``MemAvailable``), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_budget() -> int:
    """Half the memory available now, shared by the node's ranks (``LOCAL_WORLD_SIZE``, as launchers
    set it; unknown memory: no limit)."""
    free = available_memory()
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return int(free * SHARE) // ranks if free else 1 << 62


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a state dict structure (what a snapshot of it holds: of a DTensor, the
    local shard)."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None) if type(obj).__name__ == "DTensor" else None
        t = obj if local is None else local
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def pinned_bytes() -> int | None:
    """Pinned host memory torch holds now (``torch.cuda.host_memory_stats``); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        stats = torch.cuda.host_memory_stats()
    except (RuntimeError, AttributeError):
        return None
    return int(stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)))


class Budget:
    """The staging budget of one engine: ``None`` is half the memory available at the first save."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._warned = False

    def resolve(self) -> int:
        """The limit in bytes (the default is taken when first asked)."""
        if self.limit is None:
            self.limit = default_budget()
        return self.limit

    def fits(self, objects: Any, streamed_through: int) -> bool:
        """Whether a snapshot of ``objects`` fits; one WARNING the first time it does not."""
        need = tensor_bytes(objects)
        if need <= self.resolve():
            return True
        if not self._warned:
            self._warned = True
            logger.warning(
                "the state (%.2f GB) is larger than the staging budget (%.2f GB of host memory): periodic "
                "checkpoints are written synchronously, streamed through at most %.0f MB of buffers (raise "
                "staging_budget to write them in the background)",
                need / 1e9,
                self.resolve() / 1e9,
                streamed_through / 1e6,
            )
        return False
