"""spotguard: keep PyTorch training alive on spot machines (notice -> checkpoint -> exact resume).

The public names are loaded on first use (PEP 562 ``__getattr__``): ``import spotguard.notices.aws``
or ``spotguard run`` must not pay for torch, which only the Guard, ``Value`` and the checkpoint
engines need. ``from spotguard import Guard`` works as before; type checkers read the imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .checkpoint import CheckpointInfo, Manifest
    from .checkpoint.state.worker_rng import WorkerRNG
    from .errors import (
        CheckpointCorruptError,
        CheckpointExistsError,
        CheckpointFormatError,
        CheckpointMismatchError,
        ChecksumMismatchError,
        ConfigError,
        LeaseHeldError,
        LeaseLostError,
        MissingDependencyError,
        NoLoadableCheckpointError,
        SpotguardError,
        StorageAccessError,
        StorageError,
        UnloadableStateError,
    )
    from .guard import EXIT_CONFIG, EXIT_LEASE_HELD, EXIT_PREEMPTED, Guard, GuardOptions
    from .notices.base import Notice, NoticeProvider
    from .storage import Storage, open_storage
    from .value import Value
    from .watcher import Watcher

#: Public name -> the module that defines it (imported when the name is first read).
_WHERE = {
    "EXIT_CONFIG": "spotguard.guard",
    "EXIT_PREEMPTED": "spotguard.guard",
    "EXIT_LEASE_HELD": "spotguard.guard",
    "Guard": "spotguard.guard",
    "GuardOptions": "spotguard.guard",
    "CheckpointInfo": "spotguard.checkpoint",
    "Manifest": "spotguard.checkpoint",
    "CheckpointCorruptError": "spotguard.errors",
    "CheckpointExistsError": "spotguard.errors",
    "CheckpointFormatError": "spotguard.errors",
    "CheckpointMismatchError": "spotguard.errors",
    "ChecksumMismatchError": "spotguard.errors",
    "ConfigError": "spotguard.errors",
    "LeaseHeldError": "spotguard.errors",
    "LeaseLostError": "spotguard.errors",
    "MissingDependencyError": "spotguard.errors",
    "NoLoadableCheckpointError": "spotguard.errors",
    "UnloadableStateError": "spotguard.errors",
    "SpotguardError": "spotguard.errors",
    "StorageAccessError": "spotguard.errors",
    "StorageError": "spotguard.errors",
    "Notice": "spotguard.notices.base",
    "NoticeProvider": "spotguard.notices.base",
    "Storage": "spotguard.storage",
    "open_storage": "spotguard.storage",
    "Value": "spotguard.value",
    "Watcher": "spotguard.watcher",
    "WorkerRNG": "spotguard.checkpoint.state.worker_rng",
}

__all__ = [
    "EXIT_CONFIG",
    "EXIT_LEASE_HELD",
    "EXIT_PREEMPTED",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "ChecksumMismatchError",
    "ConfigError",
    "Guard",
    "GuardOptions",
    "LeaseHeldError",
    "LeaseLostError",
    "Manifest",
    "MissingDependencyError",
    "NoLoadableCheckpointError",
    "Notice",
    "NoticeProvider",
    "SpotguardError",
    "Storage",
    "StorageAccessError",
    "StorageError",
    "UnloadableStateError",
    "Value",
    "Watcher",
    "WorkerRNG",
    "__version__",
    "open_storage",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        # ``import spotguard; spotguard.checkpoint.scan(...)`` worked when every subpackage was
        # imported eagerly: a subpackage is still an attribute, imported on first use.
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
        raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
