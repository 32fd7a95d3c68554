"""The small error hierarchy every spotguard failure belongs to.

Each error subclasses a built-in as well, so callers that already catch ``ValueError`` or
``OSError`` keep working; always raise with ``from`` to keep the root cause.
"""

from __future__ import annotations


class SpotguardError(Exception):
    """Base class of every error spotguard raises on purpose."""


class ConfigError(SpotguardError, ValueError):
    """An option, URL or provider name that cannot be used as given."""


class UnloadableStateError(ConfigError):
    """The tracked state holds a value that ``torch.load(weights_only=True)`` refuses (a custom class, an enum,
    a NumPy array): found at a Guard's first save, before anything is written, since no resume could load it."""


class StorageError(SpotguardError, OSError):
    """A storage backend could not read, write, list or delete."""


class StorageAccessError(StorageError, PermissionError):
    """The storage refused this job or is not there: access denied, no credentials, a missing bucket or
    container, a local folder that cannot be read or written. A restart would meet it again."""


class CheckpointExistsError(StorageError, FileExistsError):
    """A write-once object (a manifest) already exists: another writer committed first."""


class PreconditionFailedError(StorageError):
    """A conditional write found the object not as expected: it exists (create-if-absent), or it changed
    or vanished since it was read (replace-if-unchanged). Another writer got there first."""


class LeaseHeldError(SpotguardError, RuntimeError):
    """Another job holds the live writer lease of this storage root: two writers would mix one run.

    ``spotguard run`` exits ``EXIT_LEASE_HELD`` (73) on it without restarting (a restart meets the same
    writer). ``holder`` is the other writer's ``LeaseRecord``, when it could be read."""

    def __init__(self, message: str, holder: object = None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLostError(LeaseHeldError):
    """This writer's lease was taken over (it expired, or another job took it over on purpose): it must
    commit nothing more. Raised by the fence before a manifest is written, and by ``Guard.step``."""


class CheckpointCorruptError(SpotguardError, ValueError):
    """A checkpoint failed verification: missing manifest, bad JSON, size or checksum mismatch."""


class ChecksumMismatchError(CheckpointCorruptError):
    """A file read whole hashes to another checksum than its manifest's: its bytes changed since the save.
    Unlike a load that fails or a read cut short, no retry mends it (``reader.mark_corrupt``)."""


class CheckpointMismatchError(SpotguardError, ValueError):
    """A valid checkpoint does not fit the tracked objects (missing names, wrong shapes)."""


class CheckpointFormatError(CheckpointMismatchError):
    """A checkpoint written by a newer spotguard, in a manifest format this version cannot read.

    Not a ``CheckpointCorruptError``: resume must stop and say to upgrade, not fall back to an older
    checkpoint (losing the work since) as it does past a corrupt one.
    """


class NoLoadableCheckpointError(SpotguardError, RuntimeError):
    """Checkpoints exist but none of them loads: ``resume()`` stops rather than start again from step 0,
    which would silently redo (or lose) their work. ``Guard(..., on_unloadable="fresh")`` starts fresh on purpose."""

    def __init__(self, message: str, skipped: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.skipped = skipped  # "<checkpoint>: <why it was skipped>", newest first


class MissingDependencyError(SpotguardError, ImportError):
    """An optional extra (``spotguard[aws]``, ``spotguard[gcp]`` ...) is needed but not installed."""


class SaveCancelled(SpotguardError):
    """A background save was abandoned (an emergency save needed the bandwidth)."""


#: Errors a restart would meet again unchanged: the tracked state or the options, not a passing fault. A Guard
#: that raises one from ``resume()`` or a save marks its heartbeat, and ``spotguard run`` exits
#: ``EXIT_CONFIG`` (78) instead of restarting the job into the same error until its budget is used up.
PERMANENT = (ConfigError, CheckpointMismatchError, NoLoadableCheckpointError, StorageAccessError)
