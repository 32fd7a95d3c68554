"""A final save that replaces a step: the local tier's copies of that step it makes stale.

The single-process engine's final checkpoint may differ from a periodic one of the same step (the
loop changed the state after its last ``guard.step()``): the durable copy is replaced, and a local
copy of the older content must not outlive it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from spotguard.checkpoint.folders import retention
from spotguard.checkpoint.format import reader
from spotguard.checkpoint.format.manifest import NEWER_FORMAT, CheckpointInfo, FileEntry
from spotguard.storage import Storage

logger = logging.getLogger(__name__)


def finder(
    local: Storage | None, step: int, extra: dict[str, Any], stale: list[CheckpointInfo]
) -> Callable[[tuple[FileEntry, ...]], None]:
    """For a final save: collect into ``stale`` the local tier's checkpoints of ``step`` whose
    content differs from the final one (``entries``, known before the durable tier is touched)."""

    def check(entries: tuple[FileEntry, ...]) -> None:
        if local is not None:
            extra_json = json.loads(json.dumps(extra))
            stale.extend(
                i
                for i in reader.scan(local)
                if i.step == step
                and i.status != NEWER_FORMAT  # a newer spotguard's: never deleted here
                and (i.manifest is None or i.manifest.files != entries or i.manifest.extra != extra_json)
            )

    return check


def drop(local: Storage | None, stale: list[CheckpointInfo]) -> None:
    """Delete the local copies a final save superseded, once the durable manifest is committed.

    Why only then: deleting first leaves a window where a kill finds neither copy (the durable
    one of the step is replaced, manifest first, before the new files are stored). Every point
    of a kill is safe in this order: before the durable commit the stale local copy (the state
    of the previous commit of that step) is the resume point, and no newer one exists; after
    it, both copies exist until this deletes the local one, and ``resume`` takes the copy
    committed last (the durable one). Never raises: the final checkpoint is committed.
    """
    if local is None:
        return
    for info in stale:
        try:
            retention.delete(local, info.name)
            logger.info("removed %s: the final state of step %d differs", local.describe(info.name), info.step)
        except OSError as e:  # StorageError included
            logger.warning("cannot remove the stale local copy %s: %s", info.name, e)
