"""What every trainer integration shares: the notice flag, and trainer folders as spotguard checkpoints.

Trainers write their checkpoint as a folder of files, with no commit marker and no checksums; a
kill during the save leaves a folder that looks whole, and resuming from it fails or, worse,
loads half a state. ``FolderCheckpoints`` commits such a folder to spotguard storage (files
first, manifest with SHA-256 last, ``checkpoint.write_dir``), prunes, and finds the newest folder
that verifies for the resume. ``NoticeWatch`` wraps spotguard's ``Watcher``: the trainer's loop
reads one attribute per step (``due``) and does everything else only when it is set.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from spotguard import _env, checkpoint, heartbeat
from spotguard.checkpoint.manifest import Manifest
from spotguard.checkpoint.reader import refuse_newer_format
from spotguard.guard import ranks
from spotguard.heartbeat import EXIT_PREEMPTED

from ..errors import CheckpointCorruptError, CheckpointExistsError, ConfigError
from ..notices.base import Notice, NoticeProvider
from ..storage import Storage, open_storage
from ..watcher import Watcher

if TYPE_CHECKING:
    from typing_extensions import Unpack  # noqa: F401  (in typing from 3.11)

logger = logging.getLogger(__name__)


class WatchOptions(TypedDict, total=False):
    """What every trainer integration takes by keyword, as for ``spotguard.Guard``: ``keep`` (3)
    checkpoints are kept; ``providers`` ("auto") / ``interval`` (1 s): what to watch and how often;
    ``stop_on_advisory`` (False): stop on an advisory notice instead of only checkpointing early;
    ``work_dir`` (the system's temp directory): where verified copies are fetched for a resume."""

    keep: int
    providers: str | Iterable[str | NoticeProvider] | None
    interval: float
    stop_on_advisory: bool
    work_dir: str | None


def watch_parts(storage: str | Storage | None, options: WatchOptions) -> tuple[FolderCheckpoints, NoticeWatch]:
    """The checkpoint folder and the notice watch of an integration, from its ``WatchOptions``."""
    unknown = sorted(set(options) - set(WatchOptions.__annotations__))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}; known: every_steps (where taken), {', '.join(WatchOptions.__annotations__)}"
        )
    checkpoints = FolderCheckpoints(storage, options.get("keep", 3), options.get("work_dir"))
    notices = NoticeWatch(
        options.get("providers", "auto"), options.get("interval", 1.0), options.get("stop_on_advisory", False)
    )
    return checkpoints, notices


def refuse_process_group(what: str) -> None:
    """The integrations stop one process; ranks that stop at different steps would hang each other."""
    if ranks.is_distributed() and ranks.world_size() > 1:
        raise ConfigError(
            f"{what} supports a single training process for now; in a process group use "
            "spotguard.Guard, whose ranks agree on the step to stop at"
        )


class NoticeWatch:
    """Notices from signals and cloud metadata as two flags the training loop can read for free.

    ``due`` is True once any notice arrived (stop or advisory): the one check on the hot path.
    ``preempted`` (an Event) is set for stop notices only. Call ``start()`` from the main thread
    (signal handlers), ``stop()`` when training ends.
    """

    def __init__(
        self,
        providers: str | Iterable[str | NoticeProvider] | None = "auto",
        interval: float = 1.0,
        stop_on_advisory: bool = False,
    ) -> None:
        # sigint: Ctrl-C, or `spotguard run` forwarding one, is a notice, as for Guard
        self.watcher = Watcher(
            providers, interval, on_notice=self._on_notice, stop_on_advisory=stop_on_advisory, sigint=True
        )
        self.preempted = self.watcher.preempted
        self.due = False
        self._advisory = False
        self._beat = heartbeat.attach()  # shared with `spotguard run` when $SPOTGUARD_HEARTBEAT is set

    def _on_notice(self, notice: Notice) -> None:
        if not self.preempted.is_set():
            self._advisory = True
        else:  # the job exits 75 now (exit_code): `spotguard run` reads it here when a launcher hides it
            self._beat[1] = heartbeat.STOPPED_FOR_NOTICE
        self.due = True  # last: the loop's reader sees the reason already set

    @property
    def notice(self) -> Notice | None:
        return self.watcher.notice

    def take_advisory(self) -> bool:
        """True once per advisory notice (checkpoint early, go on); re-arms ``due`` accordingly."""
        advisory, self._advisory = self._advisory, False
        self.due = self.preempted.is_set()
        return advisory

    def deadline(self) -> float | None:
        """The notice deadline as a ``time.monotonic()`` value (for storage retries), or None."""
        left = self.notice.seconds_left() if self.notice else None
        return None if left is None else time.monotonic() + left

    def start(self) -> None:
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()

    def acknowledge(self) -> None:
        if self.notice is not None:
            self.watcher.acknowledge(self.notice)  # e.g. Azure: approve the eviction, the state is safe

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice, else 0: what the job should exit with."""
        return EXIT_PREEMPTED if self.preempted.is_set() else 0


class FolderCheckpoints:
    """A trainer's checkpoint folders, committed to spotguard storage as ``step-N/`` with a manifest.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``). ``work_dir``
    holds the verified copies fetched for a resume (default: the system's temp directory).
    """

    def __init__(self, storage: str | Storage | None, keep: int = 3, work_dir: str | None = None) -> None:
        storage = _env.storage_or_env(storage)
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
        self.storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self.keep = keep
        self.work_dir = work_dir
        self.last_saved: Manifest | None = None
        self._fetched: list[Path] = []

    def commit(
        self,
        step: int,
        folder: str | Path,
        reason: str,
        deadline: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Manifest | None:
        """Store ``folder`` as checkpoint ``step`` (manifest last) and prune; None when already committed."""
        t0 = time.monotonic()
        try:
            manifest = checkpoint.write_dir(
                self.storage,
                step,
                Path(folder),
                reason=reason,
                extra=extra,
                torch_version=torch.__version__,
                deadline=deadline,
            )
        except CheckpointExistsError:
            logger.info("%s is already committed", self.storage.describe(checkpoint.step_dir(step)))
            return None
        self.last_saved = manifest
        took = time.monotonic() - t0
        tail = "" if deadline is None else f", T-{deadline - time.monotonic():.1f}s before the deadline"
        logger.log(
            logging.WARNING if reason == "emergency" else logging.INFO,
            "%s checkpoint of step %d committed to %s in %.2fs (%.1f MB)%s",
            reason,
            step,
            self.storage.describe(),
            took,
            manifest.size / 1e6,
            tail,
        )
        try:
            checkpoint.prune(self.storage, self.keep)
        except Exception as e:
            logger.warning("pruning old checkpoints in %s failed: %s", self.storage.describe(), e)
        return manifest

    def newest_verified(self) -> tuple[int, Path] | None:
        """The newest checkpoint whose files all match their manifest, as a local folder, and its step.

        Folders without a manifest (a save cut short), or whose files fail their checksums, are
        skipped with a warning naming the reason, and the previous one is tried; a newer spotguard's
        checkpoint raises ``CheckpointFormatError`` (upgrade spotguard).
        """
        for info in reversed(checkpoint.scan(self.storage)):
            where = self.storage.describe(info.name)
            refuse_newer_format(self.storage, info)  # a newer spotguard's: upgrade, never fall back past it
            if not info.complete:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                continue
            if self.work_dir:
                Path(self.work_dir).mkdir(parents=True, exist_ok=True)
            dest = Path(tempfile.mkdtemp(prefix=f"spotguard-{info.name}-", dir=self.work_dir))
            try:
                checkpoint.fetch(self.storage, info, dest)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                shutil.rmtree(dest, ignore_errors=True)
                continue
            self._fetched.append(dest)
            logger.info(
                "resuming from %s (step %d, %s)", where, info.step, info.manifest.reason if info.manifest else "?"
            )
            return info.step, dest
        logger.info("no checkpoint in %s: starting from the beginning", self.storage.describe())
        return None

    def cleanup(self) -> None:
        """Remove the local copies fetched for a resume (the trainer has loaded them)."""
        for path in self._fetched:
            shutil.rmtree(path, ignore_errors=True)
        self._fetched.clear()
