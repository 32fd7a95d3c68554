"""Resume onto the GPU at the bus's speed: a verified checkpoint's tensors copied to their devices
through pinned buffers on several threads, before ``load_state_dict``.

Why: ``load_state_dict`` of a CUDA model from ``torch.load(mmap=True)`` copies tensor after tensor
from pageable memory: 5.6 GB/s on an H200 (bench/_gpu_upload_probe.py), 1.6 s of a 9 GB warm resume
that the checksum had already read in 0.2 s. Here each thread reads its share of the file with
``pread`` into one of two small pinned buffers and uploads it on its own stream while it reads the
next: 26-33 GB/s on 8-12 threads of the same machine. ``load_state_dict`` then copies device to
device (an optimizer keeps the uploaded tensor as it is).

When: after the file's checksum matched and before anything tracked is touched; only tensors whose
live counterpart is on a CUDA device (a module's same-named tensor; an optimizer's state for a
parameter there, ``step`` excepted, as torch's own placement rule keeps it) move, so what ends where
is what ``load_state_dict`` alone would give. All or nothing: without enough free device memory, or
on any error, every tensor stays mapped and ``load_state_dict`` copies them as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

CHUNK = 4 << 20  # bytes per pinned buffer; two per thread
THREADS = max(1, min(12, os.cpu_count() or 1))
HEADROOM = 512 << 20  # device bytes left free beyond the upload
ENDS = 64  # bytes at each end of a chunk read compared with the mapping
UNIT = 64 << 20  # bytes of a tensor one thread takes at a time


def _now(end: int) -> None:
    """A file read whole already: every byte may be read now."""


class Move(NamedTuple):
    """One mapped tensor of the payload and where it goes: ``holder[key] = copy on device``."""

    holder: MutableMapping[Any, Any]
    key: Any
    tensor: torch.Tensor
    device: torch.device


def _cuda(d: torch.device) -> bool:
    return d.type == "cuda"


def moves(
    objects: Mapping[str, Any], states: Mapping[str, Any], wanted: Callable[[torch.device], bool] | None = None
) -> list[Move]:
    """The payload's tensors that ``load_state_dict`` would copy to a device ``wanted`` accepts (CUDA)."""
    wanted = wanted or _cuda
    out: list[Move] = []
    for name, obj in objects.items():
        saved = states.get(name)
        if not isinstance(saved, dict):
            continue
        if isinstance(obj, torch.nn.Module) and _plain(obj, torch.nn.Module, "_load_state_dict_pre_hooks"):
            live = obj.state_dict()
            for key, t in saved.items():
                dest = live.get(key)
                if _host(t) and isinstance(dest, torch.Tensor) and dest.shape == t.shape and wanted(dest.device):
                    out.append(Move(saved, key, t, dest.device))
        elif isinstance(obj, torch.optim.Optimizer) and _plain(
            obj, torch.optim.Optimizer, "_optimizer_load_state_dict_pre_hooks"
        ):
            out += _optimizer_moves(obj, saved, wanted)
    return out


def _plain(obj: Any, base: type, hooks: str) -> bool:
    """``obj`` saves and loads as ``base`` does (no override, no load pre-hook): only then is torch's
    placement rule the one that applies (a ``ZeroRedundancyOptimizer`` loads its own shard, a module that
    keeps the tensors it is given would keep device ones where the plain path gives it host ones)."""
    cls = type(obj)
    return (
        cls.load_state_dict is base.load_state_dict  # type: ignore[attr-defined]
        and cls.state_dict is base.state_dict  # type: ignore[attr-defined]
        and not getattr(obj, hooks, None)
    )


def _optimizer_moves(opt: torch.optim.Optimizer, saved: dict, wanted: Callable[[torch.device], bool]) -> list[Move]:
    """Torch's rule (``Optimizer.load_state_dict``): a saved id is the live parameter at the same place
    in the same group; every state tensor but ``step`` goes to that parameter's device."""
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(opt.param_groups):
        return []
    out: list[Move] = []
    for old, new in zip(groups, opt.param_groups, strict=True):
        ids = old.get("params", []) if isinstance(old, dict) else []
        if len(ids) != len(new["params"]):
            return []
        for pid, param in zip(ids, new["params"], strict=True):
            entry = state.get(pid)
            if not isinstance(entry, dict) or not wanted(param.device):
                continue
            out += [Move(entry, k, t, param.device) for k, t in entry.items() if k != "step" and _host(t)]
    return out


def _host(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and t.numel() > 0
    )


def to_devices(
    objects: Mapping[str, Any], states: Mapping[str, Any], path: Path, ready: Callable[[int], None] = _now
) -> int:
    """Move the payload's tensors bound for a CUDA device there (see the module's docstring); the
    bytes moved (0: nothing to move, too little device memory, or no CUDA). ``ready(end)`` returns once
    the file may be read up to ``end`` (the checksum's walk has read it in)."""
    if not torch.cuda.is_available():
        return 0
    t0 = time.perf_counter()
    try:
        todo = moves(objects, states)
        if not todo or not _fits(_distinct(todo)[0]):  # a tied weight takes its room once
            return 0
        moved = upload(todo, path, ready=ready)
        logger.debug("resume: %d MB to the GPU in %.2fs", moved >> 20, time.perf_counter() - t0)
        return moved
    except Exception as e:  # never fail a resume here: the payload is as loaded, load_state_dict copies it
        logger.warning(
            "resume: copying the state to the GPU through pinned memory failed (%s); load_state_dict copies it", e
        )
        return 0


def _fits(todo: list[Move]) -> bool:
    need: dict[torch.device, int] = {}
    for m in todo:
        need[m.device] = need.get(m.device, 0) + _nbytes(m.tensor)
    for device, n in need.items():
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if n + HEADROOM > free:
            logger.info(
                "resume: %d MB to load onto %s, %d MB free there: load_state_dict copies it from the mapped "
                "file instead",
                n >> 20,
                device,
                free >> 20,
            )
            return False
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def upload(
    todo: list[Move], path: Path, threads: int = THREADS, chunk: int = CHUNK, ready: Callable[[int], None] = _now
) -> int:
    """Copy each ``Move``'s tensor to its device and put the copy in its holder; bytes moved.

    The tensors are cut into pieces of at most ``UNIT`` bytes, taken in file order by the threads (so
    they read just behind ``ready``'s walk, and finish together), each streamed in ``chunk``-byte
    pieces: ``pread`` from the file where the tensor's mapping gives its offset, else a copy from the
    mapping itself, into one of the thread's two buffers (pinned for a CUDA device), uploaded on the
    thread's stream while the other fills.
    """
    todo, alias = _distinct(todo)
    offsets = file_offsets(path, [m.tensor for m in todo])
    size = os.stat(path).st_size
    copies = [torch.empty_like(m.tensor, device=m.device) for m in todo]
    after = {m.device: torch.cuda.current_stream(m.device) for m in todo if m.device.type == "cuda"}
    units = [
        (i, lo, min(lo + UNIT, _nbytes(m.tensor)))
        for i, m in enumerate(todo)
        for lo in range(0, _nbytes(m.tensor), UNIT)
    ]
    units.sort(key=lambda u: (offsets.get(u[0], size), u[1]))  # unplaced ones last: they wait for the whole walk
    local, failed = threading.local(), threading.Event()
    fd = os.open(path, os.O_RDONLY)
    try:

        def one(unit: tuple[int, int, int]) -> None:
            if failed.is_set():  # all or nothing: once a piece failed, the rest is not worth reading
                return
            i, lo, hi = unit
            m = todo[i]
            try:
                rings = local.__dict__.setdefault("rings", {})  # this thread's, one per device
                ring = rings.get(m.device) or rings.setdefault(m.device, _Ring(m.device, chunk, after.get(m.device)))
                at = offsets.get(i)
                if at is None:
                    ready(size)
                ring.copy(m.tensor, copies[i], lo, hi, fd, at, ready)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(max(1, min(threads, len(units))), thread_name_prefix="spotguard-upload") as pool:
            list(pool.map(one, units))
    finally:
        os.close(fd)
    for m, copy in zip(todo, copies, strict=True):
        m.holder[m.key] = copy
    for m, i in alias:
        m.holder[m.key] = copies[i]
    return sum(_nbytes(m.tensor) for m in todo)


def _distinct(todo: list[Move]) -> tuple[list[Move], list[tuple[Move, int]]]:
    """The moves of distinct tensors, and each repeat with the index of its first: a tensor saved under
    two names (tied weights) is one storage in the file, and one copy on the device, as it was before."""
    first: dict[tuple[Any, ...], int] = {}
    out: list[Move] = []
    alias: list[tuple[Move, int]] = []
    for m in todo:
        t = m.tensor
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), m.device)
        if key in first:
            alias.append((m, first[key]))
        else:
            first[key] = len(out)
            out.append(m)
    return out, alias


class _Ring:
    """A thread's two buffers and its stream (CUDA) for copies to ``device``."""

    def __init__(self, device: torch.device, chunk: int, after: torch.cuda.Stream | None) -> None:
        self.cuda = device.type == "cuda"
        self.bufs = torch.empty(2 * chunk, dtype=torch.uint8, pin_memory=self.cuda).view(2, chunk)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None and after is not None:
            # The copies' blocks may have been freed by work still queued on the stream they were
            # allocated on (the allocator hands them out at once): this stream's copies come after it.
            self.stream.wait_stream(after)
        self.done = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.device, self.chunk, self.turn = device, chunk, 0

    def copy(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        lo: int,
        hi: int,
        fd: int,
        at: int | None,
        ready: Callable[[int], None],
    ) -> None:
        """Bytes ``lo:hi`` of ``src`` (mapped; at file offset ``at`` when known) into ``dst`` on the device."""
        out = dst.view(-1).view(torch.uint8)
        try:
            for start in range(lo, hi, self.chunk):
                n = min(self.chunk, hi - start)
                buf, done = self.bufs[self.turn % 2], self.done[self.turn % 2]
                self.turn += 1
                if done is not None:
                    done.synchronize()  # its last upload has left the buffer
                if at is None:
                    ctypes.memmove(buf.data_ptr(), src.data_ptr() + start, n)
                else:
                    ready(at + start + n)
                    _pread_into(fd, buf.data_ptr(), n, at + start)
                    _same_ends(buf.data_ptr(), src.data_ptr() + start, n)
                if self.stream is None or done is None:
                    out[start : start + n].copy_(buf[:n])
                    continue
                with torch.cuda.stream(self.stream):
                    out[start : start + n].copy_(buf[:n], non_blocking=True)
                    done.record(self.stream)
        finally:
            if self.stream is not None:
                self.stream.synchronize()  # whole (or, on an error, no copy left in flight into a freed block)


def _same_ends(read: int, mapped: int, n: int) -> None:
    """The first and last bytes ``pread`` gave are those of the mapping (pages the checksum read in):
    a wrong file offset raises here rather than loading other bytes."""
    k = min(ENDS, n)
    if ctypes.string_at(read, k) != ctypes.string_at(mapped, k) or (
        ctypes.string_at(read + n - k, k) != ctypes.string_at(mapped + n - k, k)
    ):
        raise OSError("the bytes read from the file differ from its mapping: wrong offset")


def _pread_into(fd: int, address: int, n: int, offset: int) -> None:
    view = memoryview((ctypes.c_char * n).from_address(address)).cast("B")
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise OSError(f"file ended {n - got} bytes early at offset {offset + got}")
        got += k


def file_offsets(path: Path, tensors: list[torch.Tensor]) -> dict[int, int]:
    """Where each tensor of ``torch.load(path, mmap=True)`` lies in the file, by index: from this
    process's memory map (``/proc/self/maps``: the mapping of ``path``'s inode that holds the tensor's
    address). Tensors it cannot place are left out (they are copied from the mapping instead)."""
    try:
        # The inode only: on overlayfs (containers) the maps line names the lower layer's device, not
        # stat's. The mapping must also hold the tensor's address, and every chunk read is checked.
        ino = str(os.stat(path).st_ino)
        spans = []
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) >= 6 and parts[4] == ino:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi, int(parts[2], 16)))
    except (OSError, ValueError):
        return {}
    out: dict[int, int] = {}
    for i, t in enumerate(tensors):
        ptr, end = t.data_ptr(), t.data_ptr() + _nbytes(t)
        for lo, hi, off in spans:
            if lo <= ptr and end <= hi:
                out[i] = ptr - lo + off
                break
    return out
