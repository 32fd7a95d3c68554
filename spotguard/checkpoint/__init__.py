"""Checkpoints: what one is on disk (``format/``), what a training state is (``state/``), how one file
is written (``files/``), how ``step-N/`` folders are committed, copied and pruned (``folders/``), and the
engines that write and read one (``single``; ``sharded/`` in a process group, through ``engine``).

The names below are the public face of checkpoints in a storage (``spotguard ls`` and ``verify``
use them too); the engines (``single``, ``sharded``) import torch.distributed and are not loaded here
(``make_engine`` imports the one it makes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotguard.checkpoint.files.filewrite import Writer
from spotguard.checkpoint.folders.fence import Fence
from spotguard.checkpoint.folders.layout import copy, write, write_dir
from spotguard.checkpoint.folders.retention import delete, prune
from spotguard.checkpoint.format.manifest import (
    FORMAT,
    FORMATS,
    MANIFEST,
    REASONS,
    CheckpointInfo,
    FileEntry,
    HashingWriter,
    Manifest,
    Reshard,
    human_duration,
    parse_step_dir,
    step_dir,
)
from spotguard.checkpoint.format.reader import fetch, latest, open_verified, scan, verify

if TYPE_CHECKING:
    from spotguard.checkpoint.collective import Groups
    from spotguard.checkpoint.engine import Engine, OnCommit
    from spotguard.storage.base import Storage

__all__ = [
    "FORMAT",
    "FORMATS",
    "MANIFEST",
    "REASONS",
    "CheckpointInfo",
    "FileEntry",
    "HashingWriter",
    "Manifest",
    "Writer",
    "copy",
    "delete",
    "fetch",
    "human_duration",
    "latest",
    "make_engine",
    "open_verified",
    "parse_step_dir",
    "prune",
    "scan",
    "step_dir",
    "verify",
    "write",
    "write_dir",
]


def make_engine(
    storage: Storage,
    local: Storage | None,
    groups: Groups | None,
    keep: int,
    on_commit: OnCommit,
    staged_final: bool = True,
    reshard: Reshard | str = Reshard.REFUSE,
    rebatch: str = "refuse",
    staging_budget: int | None = None,
    fence: Fence | None = None,
) -> Engine:
    """The single-process engine, or with ``groups`` (a process group's ``Agreement``) the sharded one,
    imported only then (torch.distributed.checkpoint). Sharded saves have no local tier. ``rebatch``: see
    ``data.Rebatch``. ``fence``: the writer lease's, called before each manifest on ``storage``
    (``leaseholder.Lease.fence``). It lives here, not in ``checkpoint.engine``: the engines import that."""
    if groups is None:
        from spotguard.checkpoint.single import SingleEngine

        return SingleEngine(
            storage,
            local,
            keep,
            on_commit,
            staged_final=staged_final,
            rebatch=rebatch,
            staging_budget=staging_budget,
            fence=fence,
        )
    from spotguard.checkpoint.sharded.sharded import ShardedEngine

    return ShardedEngine(
        storage, groups, keep, on_commit, reshard=reshard, rebatch=rebatch, fence=fence, staging_budget=staging_budget
    )
