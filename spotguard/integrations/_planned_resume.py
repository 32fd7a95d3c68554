"""A resume whose path is given before the process group exists and whose files are fetched after (Lightning).

Lightning starts ``torch.distributed`` inside ``trainer.fit``, after it was given ``ckpt_path``,
and reads that path only after the callbacks' ``setup``. A fetch before ``fit`` cannot be collective,
so each rank would fetch and verify the whole checkpoint on its own. Under a launcher (``WORLD_SIZE``
> 1, no process group yet) ``plan`` instead names the copy its node will hold of the newest complete
checkpoint (every rank lists the same storage), and ``fetch``, called from ``setup``, fetches it as
every integration does: one copy per node, with the shared files and the node's own ranks' files
(``FolderCheckpoints.newest_verified``). When that newest one fails its checksums, the older one
that verifies is moved to the named place. Lightning's own launcher (``python train.py`` with
``devices=N``) sets no ``RANK``, and starts ranks 1.. from inside rank 0's ``fit``: there every rank
still fetches the whole checkpoint on its own before ``fit``, as before.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from spotguard.checkpoint.collective import agree
from spotguard.checkpoint.folders import folders
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.reader import refuse_newer_format, scan
from spotguard.coordination import ranks

from ..errors import CheckpointMismatchError, ConfigError
from ._folders import FolderCheckpoints

logger = logging.getLogger(__name__)


class PlannedResume:
    """The resume of one rank: planned before the process group exists (``plan``), fetched in it (``fetch``)."""

    def __init__(self, checkpoints: FolderCheckpoints, rule: RankFiles) -> None:
        self.checkpoints = checkpoints
        self.rule = rule
        self.planned: Path | None = None  # the node's copy, named before it is fetched
        self.step: int | None = None  # the step this rank resumes from, planned or fetched on its own
        self.failed = False  # ``fetch`` raised: the job cannot resume (``spotguard.EXIT_CONFIG``)

    def plan(self) -> Path | None:
        """Under a launcher, before the process group exists: the node's folder for the newest complete
        checkpoint, fetched later by ``fetch``. None where the resume is fetched now, as usual (a single
        process, a process group already up, or no complete checkpoint: nothing to fetch)."""
        storage = self.checkpoints.storage
        launched = {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys()  # torchrun's, not Lightning's own
        if not launched or self.checkpoints.group.get() is not None or ranks.world_size() < 2:
            return None
        complete = [info for info in scan(storage) if info.complete]
        if not complete:
            return None
        refuse_newer_format(storage, complete[-1])
        self.step = complete[-1].step
        self.planned = folders.node_folder(storage, self.step, self.checkpoints.work_dir)
        return self.planned

    def fetch(self) -> None:
        """Collective, once the process group is up and before the checkpoint is read: fetch the
        planned copy (every rank takes part when any planned one). Raises on every rank when a
        rank would resume another step than the others."""
        agreed = self.checkpoints.group.get()
        if agreed is None or not agreed.reduce(int(self.planned is not None), agreed.save_group):
            return
        self.failed = False
        try:
            self._fetch(agreed)
        except Exception:
            self.failed = True
            raise

    def _fetch(self, agreed: Any) -> None:
        found = self.checkpoints.newest_verified(self.rule)
        error: Exception | None = None
        if found is None:
            error = ConfigError(
                "no checkpoint loads, and Lightning was given one to resume: remove them to start afresh"
            )
        elif self.step is not None and self.planned is None and found[0] != self.step:
            error = CheckpointMismatchError(f"this rank resumed step {self.step}, the others step {found[0]}")
        agree(agreed, "the resume", error)
        assert found is not None
        step, folder = found
        if self.planned is not None and folder != self.planned:
            logger.warning("resuming step %d instead of step %d, which does not verify", step, self.step)
            if folders.is_node_leader():
                shutil.rmtree(self.planned, ignore_errors=True)
                folder.rename(self.planned)
                self.checkpoints.adopt(self.planned)
            agreed.reduce(0, agreed.save_group)  # every rank of the node sees the moved copy
        self.step, self.planned = step, None  # fetched: a later fit plans again
