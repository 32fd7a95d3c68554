"""One checkpoint file, written once and stored: how every writer of ours puts a file in a checkpoint.

The file is serialised through a ``DirectFile`` (past the page cache, hashed on a helper thread,
the disk written from another while the next buffer fills) into the storage's scratch directory,
then stored: a hard link on local storage, an upload from where it lies otherwise; straight to a
bucket that ``streams``, the upload reads each part as it lands, so the save takes about the slower
of the disk and the network, not their sum. The single-file engine (``layout.write``) and the
sharded one (``dcp.SpotguardWriter``, a rank's ``rank-N.pt``) both write through it, periodic and
emergency saves alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypedDict

from spotguard.checkpoint.files.fileio import DirectFile, WorkMeter
from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.errors import SaveCancelled
from spotguard.storage.base import Storage
from spotguard.storage.growing import Upload, abandoned_on_error

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Serialises one file of a checkpoint into the binary file object it is given (``torch.save(obj, f)``).
Writer = Callable[[BinaryIO], None]


class Bounds(TypedDict, total=False):
    """What bounds and counts one file's write, ``write``'s and ``put``'s keywords alike: the save's
    ``deadline`` (monotonic), the ``cancel`` event, the ``meter`` that adds the file's own work."""

    deadline: float | None
    cancel: threading.Event | None
    meter: WorkMeter | None


@dataclass(frozen=True)
class Written:
    """A file serialised at ``path``: its manifest entry, the upload CRC kept while it was written, and
    whether it is already stored (streamed to its bucket) or still to be ``store``d."""

    entry: FileEntry
    path: Path
    crc: Any
    stored: bool


def write(
    storage: Storage,
    key: str,
    name: str,
    writer: Writer,
    path: Path,
    *,
    upload_crc: Callable[[Any, Any], Any] | None = None,
    stream: bool = True,
    **bounds: Unpack[Bounds],
) -> Written:
    """Serialise ``writer``'s bytes to ``path`` (in ``storage.scratch()``), the checkpoint file ``name``
    stored as ``key``. Where the storage ``streams`` (and ``stream``), it is uploaded as it is written;
    otherwise the caller stores it (``store``).

    ``cancel``, once set, stops the file within one buffer (``SaveCancelled``); an upload in flight is
    abandoned, never completed. ``upload_crc``: the running checksum to keep (default the storage's
    own). ``meter`` adds what the file cost apart from waiting for a CPU (``DirectFile.work_seconds``).
    """
    if unknown := bounds.keys() - Bounds.__optional_keys__:  # a misspelt bound must not pass unnoticed
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; bounds: {sorted(Bounds.__optional_keys__)}")
    deadline, cancel, meter = bounds.get("deadline"), bounds.get("cancel"), bounds.get("meter")
    up = Upload(storage, key, path, deadline) if stream and storage.streams else None
    grew = up.grew if up else None
    with (
        abandoned_on_error(up),
        DirectFile(path, crc=upload_crc or storage.upload_crc, cancel=cancel, on_grow=grew) as out,
    ):
        if up is not None:
            up.attach(out)
        cpu0 = time.thread_time()
        writer(out)  # type: ignore[arg-type]  # a binary file object
        produced = time.thread_time() - cpu0
    if up is not None:
        up.finish(out.size, out.crc)
    if cancel is not None and cancel.is_set():
        raise SaveCancelled(f"save of {key} abandoned")
    if meter is not None:
        meter.seconds += out.work_seconds(produced)
    return Written(out.entry(name), Path(path), out.crc, stored=up is not None)


def put(storage: Storage, key: str, name: str, writer: Writer, **bounds: Unpack[Bounds]) -> FileEntry:
    """``write`` in a scratch directory of its own, then stored: one whole file (a shard, a rank's file).
    ``meter``: as ``write``'s (the file's own work; a file streamed to a bucket is not counted)."""
    if storage.streams:  # its time is the upload's, not the disk's and the hash's
        bounds = {**bounds, "meter": None}
    with storage.scratch() as scratch:
        written = write(storage, key, name, writer, scratch / key.rsplit("/", 1)[-1], **bounds)
        if not written.stored:
            store(storage, key, written.path, bounds.get("deadline"), written.crc)
    return written.entry


def store(storage: Storage, key: str, path: Path, deadline: float | None, crc: Any = None) -> None:
    """``put_file`` with the CRC the writer kept, for the service to check what it receives against; none
    is passed where there is none (a storage subclass written before ``crc`` existed works on)."""
    if crc is None:
        storage.put_file(key, path, deadline=deadline)
    else:
        storage.put_file(key, path, deadline=deadline, crc=crc)
