"""``torch.save`` of checkpoint files, without the zip format's CRC32 of every record.

Why: ``torch.save`` computes a CRC32 of each tensor's bytes for its zip directory, ~0.7 CPU-s per
GiB on our CI machine (3-4x the BLAKE3 checksum spotguard records for the same bytes), on the
thread that writes: in a background save, CPU taken from the training loop, which on a busy
machine lengthens its steps. Nothing needs it: ``torch.load`` never checks it (torch reads zips
without CRC checks), and a spotguard checkpoint file is checked against its manifest's checksum
before anything loads it. Its CRC fields hold 0 then: ``unzip -t`` or Python's ``zipfile.read``
would call the file damaged; ``torch.load`` of it works.

How: ``torch.serialization.set_crc32_options`` (torch 2.6+) is process-wide, and torch reads it
once, when it opens the zip writer. ``save`` switches it off under a lock, and back to what it was
at the first byte torch writes into the file (the writer is open by then), so another thread's
``torch.save`` can only meet the switch in that short window (while the object's structure is
pickled, milliseconds), and such a file still loads. Older torch: a plain ``torch.save``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import IO, Any

import torch

_switch = threading.Lock()  # one of our saves at a time between the switch and its first write


class _OnFirstWrite:
    """``f`` as torch.save sees it, calling ``first()`` before the first write reaches it."""

    def __init__(self, f: IO[bytes], first: Callable[[], None]) -> None:
        self._f, self._first = f, first

    def write(self, data: Any) -> int:
        self._first()
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:  # flush, writable, seekable, ...: the file's own
        return getattr(self._f, name)


def save(obj: Any, f: IO[bytes]) -> None:
    """``torch.save(obj, f)`` without the zip CRC32s where this torch can switch them off."""
    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    get_crc = getattr(torch.serialization, "get_crc32_options", None)
    if set_crc is None or get_crc is None:
        torch.save(obj, f)
        return
    _switch.acquire()
    try:
        previous = get_crc()
        set_crc(False)
    except BaseException:
        _switch.release()
        raise
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            restored = True
            try:
                set_crc(previous)
            finally:
                _switch.release()

    try:
        torch.save(obj, _OnFirstWrite(f, restore))  # type: ignore[arg-type]
    finally:
        restore()
