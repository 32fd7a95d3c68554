"""One item of a DCP shard file (a ``torch.save``'d tensor at an offset), read straight into its target.

``torch.load`` of an item allocates a fresh tensor (the kernel zeroes its pages) and copies the
bytes into it, and the reader then copies that tensor into the model's: three passes over memory
for each byte. A resume of a sharded checkpoint under DDP reads every shard on every rank, so those
passes, not the disk, were what kept it at ~0.75x a single-process resume per byte (bench/restore.py).
``read_into`` reads the stored bytes with ``preadv`` straight into the target: one copy from the
page cache, as ``load_state_dict`` of a memory-mapped file does.

Only the plain case is taken: the item is a ``torch.save`` zip whose single data record is stored
uncompressed, in this machine's byte order, and holds exactly the saved tensor (contiguous, from
its storage's start: what ``SpotguardWriter`` writes), and the target is a contiguous CPU tensor of
the same dtype and shape. Anything else returns False and is loaded the ordinary way. The dtype and
shape come from ``torch.load(map_location="meta", weights_only=True)``, so nothing is unpickled
outside torch's safe loader.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import zipfile
from typing import Any

import torch

from spotguard.errors import CheckpointCorruptError

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_SIGNATURE = b"PK\x03\x04"


class Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, seen as a file of their own (one saved item)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.length - self._pos)]
        n = os.preadv(self.fd, [view], self.offset + self._pos) if len(view) else 0
        self._pos += n
        return n


def _record_start(part: Slice, info: zipfile.ZipInfo) -> int | None:
    """Offset in ``part`` of a stored record's bytes (after its local header), or None."""
    header = bytearray(_LOCAL_HEADER.size)
    part.seek(info.header_offset)
    if info.compress_type != zipfile.ZIP_STORED or part.readinto(header) != len(header):
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + len(header) + name_len + extra_len
    return start if signature == _LOCAL_SIGNATURE and start + info.file_size <= part.length else None


def _data_offset(part: Slice, nbytes: int) -> int | None:
    """Offset in ``part`` of the saved tensor's bytes, or None when the item is not the plain case.

    Records are read raw, never through ``ZipFile.read``: our files carry no zip CRC32s
    (``serialize``), which ``zipfile`` would take for damage.
    """
    part.seek(0)
    try:
        with zipfile.ZipFile(part) as z:  # type: ignore[arg-type]
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError):
        # NotImplementedError: a record "version needed" zipfile does not support, which torch.load
        # (its own zip reader) still loads: not the plain case, so loaded the ordinary way.
        return None
    records = [i for i in infos if i.filename.rpartition("/")[0].endswith("/data")]
    order = next((i for i in infos if i.filename.endswith("/byteorder")), None)
    if order is not None:
        where = _record_start(part, order)
        if where is None or order.file_size > 8:
            return None
        part.seek(where)
        if part.read(order.file_size) != sys.byteorder.encode():
            return None
    if len(records) != 1 or records[0].file_size != nbytes:
        return None
    return _record_start(part, records[0])


def read_into(part: Slice, saved: torch.Tensor, target: torch.Tensor) -> bool:
    """Read the tensor stored in ``part`` (``saved``: its meta-device twin) into ``target``; False
    (nothing written) when this is not the plain case (see the module docstring)."""
    nbytes = saved.numel() * saved.element_size()
    if (
        target.device.type != "cpu"
        or target.dtype != saved.dtype
        or target.size() != saved.size()
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or not saved.is_contiguous()
        or saved.storage_offset() != 0
        or saved.untyped_storage().nbytes() != nbytes
        or target.dim() == 0
        or nbytes == 0
    ):
        return False
    start = _data_offset(part, nbytes)
    if start is None:
        return False
    view = target.reshape(-1).view(torch.uint8).numpy().data  # writable, the target's own memory
    done = 0
    while done < nbytes:  # preadv may return less than asked (signals, very large reads)
        n = os.preadv(part.fd, [view[done:]], part.offset + start + done)
        if n == 0:
            raise CheckpointCorruptError(f"item at offset {part.offset}: cut short after {done} of {nbytes} bytes")
        done += n
    return True
