"""spotguard: keep PyTorch training alive on spot machines (notice -> checkpoint -> exact resume)."""

from spotguard.checkpoint import CheckpointInfo, Manifest
from spotguard.guard import EXIT_PREEMPTED, Guard, GuardOptions

from ._version import __version__
from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointMismatchError,
    ConfigError,
    MissingDependencyError,
    SpotguardError,
    StorageError,
)
from .notices.base import Notice, NoticeProvider
from .storage import Storage, open_storage
from .value import Value
from .watcher import Watcher

__all__ = [
    "EXIT_PREEMPTED",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "ConfigError",
    "Guard",
    "GuardOptions",
    "Manifest",
    "MissingDependencyError",
    "Notice",
    "NoticeProvider",
    "SpotguardError",
    "Storage",
    "StorageError",
    "Value",
    "Watcher",
    "__version__",
    "open_storage",
]
