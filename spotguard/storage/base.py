"""The one interface every storage backend implements, and the key rules they all share.

The checkpoint layer never branches on the backend. It uses, in this order for a save:
``list(prefix)`` (find leftovers) -> ``delete(keys)`` -> ``open_write(key)`` per file ->
``put_bytes(manifest, exclusive=True)`` last (``put_file`` copies
between tiers), as the commit marker. For a resume:
``list_sizes("")`` (sizes checked against the manifest) -> ``get_bytes(manifest)`` ->
``local_copy(key)`` per file.

Keys are relative, ``/``-separated paths below the storage root (``step-00000100/state.pt``).
``deadline`` arguments are ``time.monotonic()`` values: a backend stops retrying past them, so an
emergency save never retries beyond the notice deadline.
"""

from __future__ import annotations

import abc
import builtins
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ConfigError, StorageError


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object asked for does not exist."""


#: The checkpoint layer's top-level folders, exactly as ``checkpoint.step_dir`` names them (always with
#: ``fullmatch``): ``step-`` and eight ASCII digits (more only without a leading zero), then ``.rK`` for
#: a revision. A backend looks for its leftovers only inside them (and, for local storage, its scratch
#: folders at the root). Anything else (a trailing newline, Unicode digits, ``step-000000005``) would
#: alias a real checkpoint's step.
STEP_DIR = re.compile(r"step-(?P<step>[0-9]{8}|[1-9][0-9]{8,})(?:\.r(?P<revision>[1-9][0-9]{0,5}))?")

#: The exact names backends give the temp objects of a write in flight, beside its target: local
#: storage's ``NAME.tmp-HOST@PID-XXXXXXXX`` and the parts of a GCS composite upload,
#: ``NAME.sg-part-TOKEN-NN``. Listings hide them and nothing else, and no checkpoint file may take one
#: (``reserved_name``): the two name spaces are disjoint, so a checkpoint's file is never taken for garbage.
LOCAL_TEMP_NAME = re.compile(r".+\.tmp-(?P<owner>[^/@]+@[0-9]+)-[0-9a-f]{8}")
GCS_PART_NAME = re.compile(r".+\.sg-part-[0-9a-f]{12}-[0-9]{2,}")


def reserved_name(key: str) -> bool:
    """Whether ``key``'s last part is a name a backend keeps for its temp objects."""
    name = key.rpartition("/")[2]
    return bool(LOCAL_TEMP_NAME.fullmatch(name) or GCS_PART_NAME.fullmatch(name))


#: A running upload checksum, ``update(data, state) -> state`` with ``0`` as the first state, as
#: ``zlib.crc32``: an int CRC for S3 and GCS, per-block digests for Azure (``azure_blocks.BlockSums``).
UploadCrc = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Leftover:
    """What a killed write of this backend left behind, which ``list()`` never shows: a temp file, a
    scratch folder, an unfinished multipart upload, the parts of a composite upload.

    A backend reports only names it writes itself; ``spotguard rm --incomplete`` decides (by age and
    the run's lease) which may go, and ``spotguard ls`` counts them.
    """

    key: str  # relative to the storage root: the object (or folder) it belongs to or is
    kind: str  # "temp file", "scratch folder", "multipart upload", "upload part"
    size: int  # bytes it holds
    modified: float  # its last change, seconds since the epoch (the server's clock for a cloud)
    ref: str = ""  # what removing it needs besides the key (an upload id)
    owner: str = ""  # "host@pid" of its writer, where the name records it


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key; reject traversal and odd characters."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"invalid storage key {key!r}: empty")
    if key.startswith("/") or "\\" in key or "\0" in key:
        raise ConfigError(f"invalid storage key {key!r}: must be relative, '/'-separated")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ConfigError(f"invalid storage key {key!r}: empty, '.' or '..' component")
    return key


class Storage(abc.ABC):
    """A place for checkpoints: a directory, an S3 prefix, a GCS prefix.

    Writes are atomic per object: a reader sees the whole object or nothing. ``put_bytes(...,
    exclusive=True)`` is write-once (fails with ``CheckpointExistsError`` when the key exists),
    which makes the manifest a safe commit marker even with two writers.
    """

    #: URL scheme handled ("file", "s3", "gs", "az").
    scheme: str = ""
    #: ``put_file`` of a file on the storage's filesystem stores that very file (a hard link), so an
    #: fsync of it ahead of time is the store's own (``checkpoint.files.onclose``).
    links_files: bool = False

    def __init__(self, url: str) -> None:
        self.url = url

    @abc.abstractmethod
    def open_write(self, key: str, *, deadline: float | None = None) -> AbstractContextManager[BinaryIO]:
        """A binary stream to write ``key``; the object appears only if the block exits cleanly."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes, *, exclusive: bool = False, deadline: float | None = None) -> None:
        """Write a small object at once. With ``exclusive``, fail if ``key`` already exists."""

    def scratch(self) -> AbstractContextManager[Path]:
        """A temporary local directory for files about to be ``put_file``'d (removed on exit)."""
        return _scratch_dir(None)

    @property
    def upload_crc(self) -> UploadCrc | None:
        """The running checksum this backend sends with an upload for the service to check
        (``update(data, state) -> state``, as ``zlib.crc32``), or None. A writer that keeps it while
        the bytes pass hands the final state to ``put_file(crc=...)``: the file is not read twice."""
        return None

    #: Whether ``put_stream`` uploads a file while it is still being written (``layout.write`` then
    #: streams each file it writes, instead of writing it whole and then calling ``put_file``).
    streams: bool = False

    def put_stream(self, key: str, growing: Any, *, deadline: float | None = None) -> None:
        """Store the file a writer is appending to (``storage.growing.GrowingFile``), as it grows."""
        raise NotImplementedError(f"{type(self).__name__} does not stream uploads")

    def put_file(self, key: str, path: Path, *, deadline: float | None = None, crc: Any = None) -> None:
        """Store a local file (backends override this with their parallel transfer machinery).
        ``crc``: the file's ``upload_crc``, computed when it was written (ignored where there is none)."""
        with open(path, "rb") as src, self.open_write(key, deadline=deadline) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a small object whole (manifests)."""

    @abc.abstractmethod
    def local_copy(self, key: str) -> AbstractContextManager[Path]:
        """A local file holding the object, valid inside the block (no copy for local storage)."""

    @abc.abstractmethod
    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every key that starts with ``prefix`` (recursive), in-progress temp files excluded, with its
        size in bytes as the listing reports it: a truncated object shows without reading it."""

    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix``, sorted."""
        return sorted(self.list_sizes(prefix))

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the keys that exist; missing ones are ignored."""

    def exists(self, key: str) -> bool:
        return key in self.list(key)

    def list_times(self, prefix: str = "") -> dict[str, float]:
        """Every key that ``list(prefix)`` returns, with its last change (seconds since the epoch).

        ``spotguard rm --incomplete`` leaves alone what changed recently; a backend without it
        (this default) has every key's age unknown, so nothing of it is ever judged old.
        """
        return {}

    def leftovers(self) -> builtins.list[Leftover]:
        """What killed writes left under the root, in this backend's own names (none by default)."""
        return []

    def remove_leftover(self, item: Leftover) -> None:  # noqa: B027 - optional hook
        """Delete one of ``leftovers()`` (gone already is no error)."""

    # -- conditional writes (the writer lease, ``spotguard.checkpoint.lease``) -------------------
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """A small object's bytes and its version token, for a later ``put_conditional``.

        Raises ``ObjectNotFoundError`` when it does not exist. Backends implement it with what their
        service compares atomically: an ETag (S3, Azure), a generation (GCS), a content hash (local).
        """
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def put_conditional(self, key: str, data: bytes, *, token: str | None, deadline: float | None = None) -> str:
        """Write a small object only if it is as expected; return its new version token.

        ``token=None``: create-if-absent. Else replace-if-unchanged: only while the object is still
        the version ``token`` names (from ``get_versioned`` or the previous ``put_conditional``).
        Raises ``PreconditionFailedError`` when the condition fails: another writer got there first.
        A retried request whose first attempt landed is recognised by its bytes and counts as ours.
        """
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and pools."""

    def describe(self, key: str = "") -> str:
        """A human-readable location for messages."""
        return self.url.rstrip("/") + ("/" + key if key else "")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


@contextmanager
def _scratch_dir(parent: Path | None, tag: str = "") -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=".spotguard.tmp-" + tag, dir=parent) as d:
        yield Path(d)
