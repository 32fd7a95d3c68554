"""torch.distributed.checkpoint (DCP) over spotguard's ``Storage`` interface (local, S3, GCS alike).

Why our own StorageWriter/Reader instead of DCP's ``FileSystemWriter`` or fsspec writer: every
shard file is written as the single-file engine writes its state (``filewrite``: O_DIRECT past the
page cache, hashed on a helper thread as it passes, stored atomically or streamed to a bucket as it
lands, a cancel honoured within one buffer), and reads go through ``checkpoint.open_verified`` so
nothing unverified is deserialised.

Layout below ``<step-dir>/shards/``: ``rank-00003.distcp`` (the items rank 3 wrote: each a
``torch.save``'d tensor or a byte blob at an offset) and ``metadata.dcp`` (DCP's ``Metadata``,
written by the coordinator in ``finish()``; read back with an unpickler that admits only DCP's
metadata classes). DCP calls a writer in this order: ``set_up_storage_writer`` (all ranks) ->
``prepare_local_plan`` (all) -> ``prepare_global_plan`` (coordinator) -> ``write_data`` (all) ->
``finish`` (coordinator); a reader: ``read_metadata`` -> ``set_up_storage_reader`` ->
``prepare_local_plan`` -> ``prepare_global_plan`` -> ``read_data``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from spotguard.checkpoint.files import filewrite, stream
from spotguard.checkpoint.files.fileio import WorkMeter
from spotguard.checkpoint.format.manifest import FileEntry, HashingWriter
from spotguard.checkpoint.sharded import item_io
from spotguard.checkpoint.sharded.item_io import Slice
from spotguard.errors import CheckpointCorruptError, SaveCancelled
from spotguard.storage.base import Storage

METADATA_FILE = "metadata.dcp"


def shard_file(rank: int) -> str:
    return f"rank-{rank:05d}.distcp"


@dataclass(frozen=True)
class ShardLocation:
    """Where one saved item lives: a file relative to the shards directory, a byte range in it."""

    relative_path: str
    offset: int
    length: int


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    """This tensor alone in its storage, where it lives: ``torch.save`` of a view would write the whole
    storage behind it. A device tensor stays on the device: ``stream.save`` carries it to the file in
    chunks through pinned buffers, instead of a pageable copy of the whole item first."""
    t = tensor.detach()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class SpotguardWriter(StorageWriter):
    """Writes one rank's shard file (and, on the coordinator, the metadata) through ``storage``.

    ``entries`` collects the ``FileEntry`` (name relative to the step dir, size, checksum) of each
    file this rank wrote, for the manifest. ``cancel``, when set, abandons the write before the
    next item or file with ``SaveCancelled`` (the partial file is removed by ``open_write``): an
    abandoned background save stops streaming instead of competing with the emergency save.
    """

    def __init__(
        self,
        storage: Storage,
        step_dir: str,
        rank: int,
        *,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        ring: stream.Ring | None = None,
        meter: WorkMeter | None = None,
    ) -> None:
        super().__init__()
        self.storage = storage
        self.prefix = f"{step_dir}/shards"
        self.rank = rank
        self.deadline = deadline
        self.cancel = cancel
        self.ring = ring or stream.Ring()
        self.meter = meter  # adds the shard file's own work (``filewrite.put``)
        self.entries: list[FileEntry] = []

    def _check_cancel(self, what: str) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled(f"sharded save to {self.prefix} abandoned before {what} (rank {self.rank})")

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.entries = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Rank i writes rank-0000i.distcp; the name travels in storage_data.
        return [dataclasses.replace(p, storage_data=shard_file(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fname = plan.storage_data if isinstance(plan.storage_data, str) else shard_file(self.rank)
        results = []
        self._check_cancel(fname)

        def write_items(out: Any) -> None:  # a DirectFile: a large item is given up within one buffer
            for item in plan.items:
                self._check_cancel(f"{item.index.fqn} in {fname}")
                data = planner.resolve_data(item)
                offset = out.size
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data))
                else:
                    stream.save(_alone(data), out, self.ring)  # type: ignore[arg-type]  # a tensor item; streamed, no copy
                length = out.size - offset
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=length, storage_data=ShardLocation(fname, offset, length)
                    )
                )

        entry = filewrite.put(
            self.storage,
            f"{self.prefix}/{fname}",
            f"shards/{fname}",
            write_items,
            deadline=self.deadline,
            cancel=self.cancel,
            meter=self.meter,
        )
        self.entries.append(entry)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
        self._check_cancel(METADATA_FILE)
        with self.storage.open_write(f"{self.prefix}/{METADATA_FILE}", deadline=self.deadline) as raw:
            out = HashingWriter(raw)
            pickle.dump(metadata, out, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[arg-type]
        self.entries.append(out.entry(f"shards/{METADATA_FILE}"))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked automatically: constructed explicitly by spotguard


# DCP's metadata is a pickle of a few plain dataclasses. Admit exactly those (and the torch types
# they hold); anything else in the file is refused before it can run.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    (__name__, "ShardLocation"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),
}


# Metadata written before checkpoint/ had subpackages names ShardLocation by its old module.
_MOVED = {("spotguard.checkpoint.dcp", "ShardLocation"): ShardLocation}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _MOVED:
            return _MOVED[module, name]
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_metadata(path: Path) -> Metadata:
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:
        raise CheckpointCorruptError(f"{path.name}: unreadable DCP metadata ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path.name}: not DCP metadata")
    return metadata


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, off, length)
    return tensor


Opener = Callable[[str], AbstractContextManager[Path]]


class SpotguardReader(StorageReader):
    """Reads a sharded checkpoint; ``open_verified(name)`` yields a local, checksum-verified copy.

    Use as a context manager: verified copies (downloads, for cloud storage) stay until the end,
    so each file is fetched and hashed once even when several items live in it (resharding).
    """

    def __init__(self, open_verified: Opener) -> None:
        super().__init__()
        self._open_verified = open_verified
        self._paths: dict[str, Path] = {}
        self._stack = ExitStack()
        self.bytes_read = 0

    def __enter__(self) -> SpotguardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._paths.clear()

    def _path(self, name: str) -> Path:
        if name not in self._paths:
            self._paths[name] = self._stack.enter_context(self._open_verified(f"shards/{name}"))
        return self._paths[name]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return load_metadata(self._path(METADATA_FILE))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[ShardLocation, Any]]] = {}
        for item in plan.items:
            loc = self.storage_data[item.storage_index]
            if not isinstance(loc, ShardLocation):
                raise CheckpointCorruptError(f"DCP metadata has no location for {item.storage_index.fqn}")
            by_file.setdefault(loc.relative_path, []).append((loc, item))
        for name, items in by_file.items():
            with open(self._path(name), "rb", buffering=0) as f:
                for loc, item in sorted(items, key=lambda p: p[0].offset):
                    self.bytes_read += loc.length
                    self._load_item(name, Slice(f.fileno(), loc.offset, loc.length), item, planner)
        return _done(None)

    @staticmethod
    def _load_item(name: str, part: Slice, item: Any, planner: LoadPlanner) -> None:
        # weights_only first: DCP's default planner unpickles byte items freely; we only hand it
        # content that already loads safely. A tensor item is loaded to the meta device first (its
        # dtype and shape, no bytes read); when it fills its target whole, its bytes are then read
        # straight into the target: one copy from the page cache, where loading it to the CPU
        # would allocate a fresh tensor and copy twice (``item_io.read_into``).
        if item.type == LoadItemType.BYTE_IO:
            _safe_load(name, part, item, "cpu")
            part.seek(0)
            planner.load_bytes(item, io.BytesIO(part.read()))
            return
        saved = _safe_load(name, part, item, "meta")
        if not isinstance(saved, torch.Tensor):
            raise CheckpointCorruptError(f"shards/{name}: {item.storage_index.fqn} is not a tensor")
        wanted = _narrow(saved, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != wanted.size():
            raise CheckpointCorruptError(
                f"shards/{name}: {item.storage_index.fqn} has shape {tuple(wanted.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        if wanted.size() != saved.size() or not item_io.read_into(part, saved, target):
            part.seek(0)
            target.copy_(_narrow(_safe_load(name, part, item, "cpu"), item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def _safe_load(name: str, part: Slice, item: Any, device: str) -> Any:
    try:
        return torch.load(part, map_location=device, weights_only=True)  # type: ignore[arg-type]
    except Exception as e:
        raise CheckpointCorruptError(f"shards/{name}: {item.storage_index.fqn} cannot be loaded safely ({e})") from e
