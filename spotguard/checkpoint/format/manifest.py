"""What a checkpoint is on paper: its directory name, its manifest (the commit marker) and file entries.

The manifest is JSON, never pickle: ``Manifest.from_bytes`` validates every field, and a file name
that could leave its checkpoint directory is refused. Its size, nesting and numbers are bounded
(``bounds``): a manifest outside them is corrupt, and writers refuse to commit one. A ``spotguard/N`` format newer than this
version reads is not corrupt but a ``CheckpointFormatError`` (upgrade spotguard), so that a resume
never falls back past it.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from spotguard._version import __version__
from spotguard.checkpoint.format import bounds, digest
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError, ConfigError, SaveCancelled
from spotguard.storage.base import STEP_DIR, reserved_name

# spotguard/3: the checksum algorithm named per file (BLAKE3 by default); readers take
# "spotguard/2" (SHA-256 per chunk) and "spotguard/1" (whole-file SHA-256) too.
FORMAT = "spotguard/3"
FORMATS = ("spotguard/1", "spotguard/2", FORMAT)
_SHA256_FORMATS = FORMATS[:2]  # files carry "sha256" (and "chunk_size"), not "digest"
NEWER_FORMAT = "newer-format"  # the status of a checkpoint written by a newer spotguard (see ``CheckpointInfo``)
_NUMBERED_FORMAT = re.compile(r"^spotguard/([0-9]{1,6})$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]{0,39}$")
MANIFEST = "manifest.json"
REASONS = ("periodic", "emergency", "final", "advisory", "manual")
# A path component may start with a dot (DCP's ``.metadata``, which Lightning's sharded FSDP checkpoint
# holds) but may not be ``.`` or ``..``.
_PART = r"(?!\.\.?(?:/|$))[A-Za-z0-9._][A-Za-z0-9._-]*"
_FILE_NAME = re.compile(rf"^{_PART}(/{_PART})*$")


def step_dir(step: int, revision: int = 0) -> str:
    """The directory of checkpoint ``step``: ``step-NNNNNNNN``, or ``step-NNNNNNNN.rK`` for revision K > 0.

    A revision supersedes the checkpoints of its step with a lower one (an evaluation's cut state
    replacing a periodic checkpoint of the step it follows): it is written beside them, so the one it
    replaces stays the resume point until its manifest lands, and readers take the highest revision."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(revision, int) or isinstance(revision, bool) or not 0 <= revision < 1_000_000:
        raise ConfigError(f"revision must be an int from 0 to 999999, got {revision!r}")
    return f"step-{step:08d}" + (f".r{revision}" if revision else "")


def check_file_name(fname: str) -> None:
    """Refuse a file name that is not a plain relative path inside its checkpoint, is the manifest's, or
    is one a backend keeps for its temp objects (listings hide those: the checkpoint would read as broken)."""
    if not _FILE_NAME.fullmatch(fname) or fname == MANIFEST:
        raise ConfigError(f"invalid checkpoint file name {fname!r}")
    if reserved_name(fname):
        raise ConfigError(f"invalid checkpoint file name {fname!r}: storage backends name their temp objects so")


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-NNNNNNNN`` (or ``step-NNNNNNNN.rK``) name, or None for anything else."""
    m = STEP_DIR.fullmatch(name)
    return int(m["step"]) if m else None


def dir_order(name: str) -> tuple[int, int]:
    """(step, revision) of a checkpoint directory's name: directories sort by it, the newest last."""
    m = STEP_DIR.fullmatch(name)
    return (int(m["step"]), int(m["revision"] or 0)) if m else (0, 0)


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint. ``checksum`` is the ``digest.ChunkedDigest`` of the file with
    algorithm ``alg`` when ``chunk_size`` > 0, else (manifests of spotguard/1) the SHA-256 of the
    whole file."""

    name: str
    size: int
    checksum: str
    chunk_size: int = 0
    alg: str = digest.SHA256

    def to_json(self, fmt: str) -> dict[str, Any]:
        """The entry as manifests of format ``fmt`` write it (an old manifest copied stays as it was)."""
        if fmt not in _SHA256_FORMATS:
            return {"name": self.name, "size": self.size, "digest": _digest_json(self)}
        if self.alg != digest.SHA256:
            raise ConfigError(f"{self.name}: a {fmt} manifest cannot record a {self.alg} checksum")
        out: dict[str, Any] = {"name": self.name, "size": self.size, "sha256": self.checksum}
        if self.chunk_size or fmt != "spotguard/1":
            out["chunk_size"] = self.chunk_size
        return out

    @classmethod
    def from_json(cls, f: Any, fmt: str) -> FileEntry:
        """Parse one entry of a manifest of format ``fmt``; ``ValueError``/``KeyError``/``TypeError`` if invalid."""
        name, size = f["name"], f["size"]
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name.split("/"):
            raise ValueError(f"unsafe file name {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"bad size for {name!r}")
        if fmt in _SHA256_FORMATS:
            alg, value, chunk = digest.SHA256, f["sha256"], f.get("chunk_size", 0)
        else:
            d = f["digest"]
            if not isinstance(d, dict):
                raise ValueError(f"bad digest for {name!r}")
            alg, value, chunk = d["alg"], d["value"], d["chunk"]
            if alg not in digest.ALGORITHMS:
                raise ValueError(f"unknown checksum algorithm {alg!r} for {name!r}")
            if chunk == 0:
                raise ValueError(f"bad chunk for {name!r}: format {fmt} checksums are chunked")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise ValueError(f"bad chunk_size for {name!r}")
        if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{digest.HEX_LENGTH[alg]}}}", value):
            raise ValueError(f"bad {alg} checksum for {name!r}")
        return cls(name, size, value, chunk, alg)


def _digest_json(entry: FileEntry) -> dict[str, Any]:
    return {"alg": entry.alg, "chunk": entry.chunk_size, "value": entry.checksum}


@dataclass(frozen=True)
class Manifest:
    step: int
    reason: str
    files: tuple[FileEntry, ...]
    time: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat())
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    spotguard_version: str = __version__
    torch_version: str = ""
    format: str = FORMAT

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def age_seconds(self) -> float | None:
        """Seconds since the checkpoint was written (None when its time cannot be read)."""
        try:
            written = dt.datetime.fromisoformat(self.time)
        except ValueError:
            return None
        if written.tzinfo is None:
            written = written.replace(tzinfo=dt.timezone.utc)
        return (dt.datetime.now(dt.timezone.utc) - written).total_seconds()

    def to_bytes(self) -> bytes:
        try:
            data = asdict(self)
            data["files"] = [f.to_json(self.format) for f in self.files]
            raw = json.dumps(data, indent=1, sort_keys=True).encode()
            bounds.check_written(raw, data)
        except RecursionError as e:
            raise ConfigError(f"checkpoint of step {self.step} not written: guard.extra nested too deep") from e
        except ValueError as e:
            raise ConfigError(f"checkpoint of step {self.step} not written: {e}") from e
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """Parse and validate; anything unexpected is a ``CheckpointCorruptError``, a ``spotguard/N``
        format newer than this version reads a ``CheckpointFormatError``."""
        try:
            data = bounds.load_json(raw)
            if not isinstance(data, dict) or data.get("format") not in FORMATS:
                _refuse_newer_format(data, where)
                raise ValueError(f"not a {' or '.join(FORMATS)} manifest")
            bounds.check_manifest(data)
            files = [FileEntry.from_json(f, data["format"]) for f in data["files"]]
            if not files:
                raise ValueError("no files listed")
            step = data["step"]
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"bad step {step!r}")
            extra = data.get("extra") or {}
            if not isinstance(extra, dict):
                raise ValueError("extra must be an object")
            return cls(
                step=step,
                reason=str(data["reason"]),
                files=tuple(files),
                time=str(data["time"]),
                world_size=int(data.get("world_size", 1)),
                extra=extra,
                spotguard_version=str(data.get("spotguard_version", "")),
                torch_version=str(data.get("torch_version", "")),
                format=data["format"],
            )
        except CheckpointFormatError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(f"{where}: invalid manifest ({e})") from e


def _refuse_newer_format(data: Any, where: str) -> None:
    """Raise ``CheckpointFormatError`` for a ``spotguard/N`` manifest with N above the formats read here.

    Only the format (and the writer's version, for the message) is read: a newer format may
    change every other field. Anything else unknown stays an invalid manifest.
    """
    fmt = data.get("format") if isinstance(data, dict) else None
    m = _NUMBERED_FORMAT.fullmatch(fmt) if isinstance(fmt, str) else None
    if m is None or int(m.group(1)) <= max(int(f.partition("/")[2]) for f in FORMATS):
        return
    version = data.get("spotguard_version")
    writer = f"spotguard {version}" if isinstance(version, str) and _VERSION.fullmatch(version) else "a newer spotguard"
    raise CheckpointFormatError(
        f"{where} was written by {writer} in manifest format {fmt}, which spotguard {__version__} cannot read "
        f"(it reads {', '.join(FORMATS)}): upgrade spotguard (pip install -U spotguard)"
    )


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step-N/`` (or ``step-N.rK/``) directory as found in storage."""

    step: int
    name: str
    status: str  # "complete" | "incomplete" | "corrupt" | "newer-format" (NEWER_FORMAT: upgrade spotguard)
    manifest: Manifest | None = None
    problem: str = ""
    #: Corrupt for good: a valid manifest names a file the listing lacks, or shows with another size.
    #: Unlike an unreadable manifest (maybe a passing fault) no retry mends it: ``prune`` and
    #: ``spotguard rm --incomplete`` treat it as garbage.
    broken: bool = False

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @property
    def revision(self) -> int:
        """0, or K for ``step-NNNNNNNN.rK``: a later revision of the step supersedes this one."""
        return dir_order(self.name)[1]


class HashingWriter:
    """A write-through wrapper that counts and hashes bytes as they pass (for streamed writes, e.g. DCP)."""

    PIECE = 16 << 20  # with ``cancel``: bytes written between two checks of it

    def __init__(self, raw: BinaryIO, cancel: threading.Event | None = None) -> None:
        """``cancel``: once set, the next piece of a write raises ``SaveCancelled`` (a large tensor is given
        up within ``PIECE`` bytes, not at its end)."""
        self.raw = raw
        self.size = 0
        self._hash = digest.ChunkedDigest()
        self.chunk_size = self._hash.chunk_size
        self.alg = self._hash.alg
        self._cancel = cancel

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._cancel is None:
            return self._write(data)
        mv = memoryview(data).cast("B")
        for start in range(0, len(mv), self.PIECE):
            if self._cancel.is_set():
                raise SaveCancelled("save abandoned while writing a file")
            self._write(mv[start : start + self.PIECE])
        return len(mv)

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        self._hash.update(data)
        n = self.raw.write(data)
        self.size += len(data) if n is None else n
        return len(data) if n is None else n

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def entry(self, name: str) -> FileEntry:
        """The manifest entry of the bytes written so far, stored as ``name``."""
        return FileEntry(name, self.size, self.hexdigest(), self.chunk_size, self.alg)


def human_duration(seconds: float | None) -> str:
    """``42s``, ``3.5 min``, ``2.1 h`` (ages and waits in log lines)."""
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Reshard(str, enum.Enum):
    """What to do when a checkpoint was saved by a different number of ranks."""

    REFUSE = "refuse"  # raise: per-rank state (RNG, data positions) cannot be split or merged
    RESET_DATA = "reset-data"  # reshard model/optimizer, restart per-rank RNG and loader positions
