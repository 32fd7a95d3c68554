"""The writer lease of a run: which process may commit checkpoints under a storage root.

One small JSON object, ``spotguard-lease.json`` at the storage root, beside the ``step-N/`` folders
(``scan`` ignores it). A writer creates it with the backend's create-if-absent write, renews it from a
heartbeat with replace-if-unchanged, and releases it at a clean exit. A record not renewed within its
``ttl_s`` is expired: the next writer may take it over, once it has seen the record unchanged for
``ttl_s`` on its own monotonic clock (``leaseholder``; docs/lease.md): the timestamps are the holder's
wall clock, which may be far from the taker's. This module holds the record and its reader, which
``spotguard rm --incomplete`` and ``ls`` use to leave a live run's files alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from spotguard.errors import CheckpointCorruptError, CheckpointFormatError
from spotguard.storage.base import ObjectNotFoundError, Storage

#: The lease's key at the storage root.
LEASE = "spotguard-lease.json"
FORMAT = "spotguard-lease/1"
#: How far two machines' clocks may disagree before a record reads as renewed in the future.
CLOCK_TOLERANCE_S = 1.0
#: A lease record is a few hundred bytes; anything much larger is not one.
MAX_BYTES = 16 << 10
#: The longest TTL a Guard accepts (``GuardOptions.lease_ttl``): a record claiming more is not one of ours.
MAX_TTL_S = 1e7
_FORMAT_NAME = re.compile(r"spotguard-lease/([1-9][0-9]{0,5})")


class NewerLeaseError(CheckpointFormatError):
    """A lease record of a newer format: a newer spotguard holds (or held) this run, and this version
    cannot judge its record. ``holder`` names it as far as it can be read."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def pid_namespace() -> str:
    """Which processes this one can see: the kernel's boot id and this process's pid namespace (Linux;
    "" elsewhere). A pid in a record is judged only by a process of the same namespace: on one host,
    containers (host networking, Kubernetes ``hostNetwork``) share the hostname but not their pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


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
    #: ``pid_namespace()`` of the holder: only a process of that namespace may judge ``pid`` ("": unknown).
    pidns: str = ""

    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_s

    def live(self, now: float | None = None) -> bool:
        """Held and renewed recently enough: its files are a running job's, not garbage."""
        return not self.released and (time.time() if now is None else now) < self.expires_at()

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.acquired_at

    def describe(self, now: float | None = None) -> str:
        """Who holds it, for messages; ``now`` is this machine's clock, which may disagree with the holder's."""
        now = time.time() if now is None else now
        ahead = self.renewed_at - now
        if ahead > CLOCK_TOLERANCE_S:  # the holder's clock is ahead of ours: no negative ages
            when = f"holding for {self.renewed_at - self.acquired_at:.0f} s, its clock {ahead:.0f} s ahead of this machine's"
        else:
            when = f"holding for {self.age(now):.0f} s, renewed {max(0.0, -ahead):.0f} s ago"
        return f"run {self.run_id} on host {self.host} pid {self.pid}, {when}"

    def from_the_future(self, now: float) -> bool:
        """Renewed later than ``now`` by more than the clocks of two machines should disagree."""
        return self.renewed_at - now > CLOCK_TOLERANCE_S

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
            fmt = doc.get("format") if isinstance(doc, dict) else None
            m = _FORMAT_NAME.fullmatch(fmt) if isinstance(fmt, str) else None
            if m and int(m[1]) > 1:
                holder = _holder(doc)
                raise NewerLeaseError(f"{LEASE} is a {fmt} record, of a newer spotguard, held by {holder}", holder)
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
                pidns=_text(doc.get("pidns", "")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: 10**400 as a float
            raise CheckpointCorruptError(f"{LEASE}: bad field ({e})") from e
        if record.ttl_s > MAX_TTL_S:
            raise CheckpointCorruptError(f"{LEASE}: bad field (a TTL of {record.ttl_s:g} s)")
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


def _holder(doc: dict[str, Any]) -> str:
    """The holder a record of another format names, as far as it can be read."""
    parts = [f"{key} {doc[key]!r}"[:80] for key in ("run_id", "host", "pid") if isinstance(doc.get(key), (str, int))]
    return ", ".join(parts) or "a holder it does not name"


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 512:
        raise TypeError("expected a short string")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise TypeError("expected a non-negative integer")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("expected a finite non-negative number")
    seconds = float(value)  # OverflowError for an int past any float: corrupt, as above
    if not math.isfinite(seconds) or seconds < 0:
        raise TypeError("expected a finite non-negative number")
    return seconds


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("expected true or false")
    return value
