"""The writer lease of a run: which process may commit checkpoints under a storage root.

One small JSON object, ``spotguard-lease.json`` at the storage root, beside the ``step-N/`` folders
(``scan`` ignores it). A writer creates it with the backend's create-if-absent write, renews it from a
heartbeat with replace-if-unchanged, and releases it at a clean exit. A record not renewed within its
``ttl_s`` is expired: the next writer may take it over. This module holds the record and its reader,
which ``spotguard rm --incomplete`` and ``ls`` use to leave a live run's files alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from spotguard.errors import CheckpointCorruptError
from spotguard.storage.base import ObjectNotFoundError, Storage

#: The lease's key at the storage root.
LEASE = "spotguard-lease.json"
FORMAT = "spotguard-lease/1"
#: A lease record is a few hundred bytes; anything much larger is not one.
MAX_BYTES = 16 << 10


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds the lease, and until when (wall-clock seconds since the epoch)."""

    run_id: str
    host: str
    pid: int
    acquired_at: float
    renewed_at: float
    ttl_s: float
    released: bool = False
    #: A random id per acquisition: tells a writer its own record from another's (same host and pid included).
    owner: str = ""

    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_s

    def live(self, now: float | None = None) -> bool:
        """Held and renewed recently enough: its files are a running job's, not garbage."""
        return not self.released and (time.time() if now is None else now) < self.expires_at()

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.acquired_at

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        return (
            f"run {self.run_id} on host {self.host} pid {self.pid}, "
            f"holding for {self.age(now):.0f} s, renewed {now - self.renewed_at:.0f} s ago"
        )

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord:
        """Parse a record; anything else (too big, not JSON, a field of the wrong type) is corrupt."""
        if len(data) > MAX_BYTES:
            raise CheckpointCorruptError(f"{LEASE}: {len(data)} bytes, not a lease record")
        try:
            doc: Any = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise CheckpointCorruptError(f"{LEASE}: not JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{LEASE}: not a {FORMAT} record")
        try:
            record = cls(
                run_id=_text(doc["run_id"]),
                host=_text(doc["host"]),
                pid=_integer(doc["pid"]),
                acquired_at=_seconds(doc["acquired_at"]),
                renewed_at=_seconds(doc["renewed_at"]),
                ttl_s=_seconds(doc["ttl_s"]),
                released=_flag(doc.get("released", False)),
                owner=_text(doc.get("owner", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointCorruptError(f"{LEASE}: bad field ({e})") from e
        return record


def read(storage: Storage) -> LeaseRecord | None:
    """The lease record under ``storage``, or ``None`` when there is none. A corrupt one raises."""
    return read_versioned(storage)[0]


def read_versioned(storage: Storage) -> tuple[LeaseRecord | None, str | None]:
    """The lease record and its version token (``Storage.get_versioned``): a later read with the same
    token saw the same record. (None, None) when there is none; a corrupt record raises."""
    try:
        try:
            data, token = storage.get_versioned(LEASE)
        except NotImplementedError:  # a backend without conditional writes: the bytes are the version
            data = storage.get_bytes(LEASE)
            token = hashlib.sha256(data).hexdigest()
    except (ObjectNotFoundError, FileNotFoundError):
        return None, None
    return LeaseRecord.from_bytes(data), token


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 512:
        raise TypeError("expected a short string")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise TypeError("expected a non-negative integer")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TypeError("expected a finite non-negative number")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("expected true or false")
    return value
