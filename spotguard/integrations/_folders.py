"""A trainer's checkpoint folders as spotguard checkpoints: committed with a manifest, pruned, fetched verified.

Trainers write their checkpoint as a folder of files, with no commit marker and no checksums; a
kill during the save leaves a folder that looks whole, and resuming from it fails or, worse,
loads half a state. ``FolderCheckpoints`` commits such a folder to spotguard storage (files
first, manifest with checksums last), prunes, and finds the newest folder that verifies for the
resume; in a process group through the integration's ``RankGroup`` (``spotguard.checkpoint.folders.folders``).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from spotguard import _env, checkpoint, heartbeat
from spotguard.checkpoint.files.onclose import ClosedFileHashes
from spotguard.checkpoint.folders import folders, layout, retention
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.manifest import CheckpointInfo, Manifest
from spotguard.checkpoint.format.reader import mark_corrupt, none_loads, refuse_newer_format
from spotguard.checkpoint.leaseholder import DEFAULT_TTL_S
from spotguard.checkpoint.state import data, state
from spotguard.checkpoint.state.data import Rebatch
from spotguard.checkpoint.state.state import Untracked
from spotguard.coordination.group import RankGroup
from spotguard.coordination.lease import WriterLease

from ..errors import CheckpointCorruptError, CheckpointExistsError, CheckpointMismatchError, ConfigError, LeaseHeldError
from ..storage import Storage, open_storage

logger = logging.getLogger(__name__)


class FolderCheckpoints:
    """A trainer's checkpoint folders, committed to spotguard storage as ``step-N/`` with a manifest.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``). ``work_dir``
    holds the verified copies fetched for a resume (default: the system's temp directory). In a
    process group (``group``) ``commit`` and ``newest_verified`` are collective: every rank passes
    the folder it (or its node) wrote, and gets the folder its node fetched. The first of them takes
    the run's writer lease (docs/lease.md; ``lease_ttl=None``: none), ``release()`` gives it back
    (the integrations' ``close()``; after a stop's last checkpoint, ``NoticeWatch.stop_saved``).
    """

    def __init__(
        self,
        storage: str | Storage | None,
        keep: int = 3,
        work_dir: str | None = None,
        group: RankGroup | None = None,
        fresh_ok: bool = False,
        *,
        lease_ttl: float | None = DEFAULT_TTL_S,
        takeover: bool | None = None,
        untracked: str = "refuse",
        rebatch: str = "refuse",
    ) -> None:
        storage = _env.storage_or_env(storage)
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
        if lease_ttl is not None and not (isinstance(lease_ttl, (int, float)) and 0 < lease_ttl < 1e7):
            raise ConfigError(f"lease_ttl must be a positive number of seconds or None, got {lease_ttl!r}")
        self.storage = storage if isinstance(storage, Storage) else open_storage(storage)
        takeover = _env.flag(_env.TAKEOVER, default=False) if takeover is None else takeover
        self.lease = WriterLease(self.storage, lease_ttl, bool(takeover), None, self)
        self._beat = heartbeat.Beat()  # `spotguard run` does not restart a job another one writes over
        self._tidy = retention.Housekeeping(keep)  # rank 0's: pruning, and saves killed mid-write
        self.work_dir = work_dir
        self.group = group or RankGroup()
        self.fresh_ok = fresh_ok  # on_unloadable="fresh": checkpoints that all fail to load mean a fresh start
        try:  # what the integration's resume does with saved state nothing restores (state.refuse_untracked)
            self.untracked = Untracked(untracked)
        except ValueError:
            raise ConfigError(f"untracked must be one of {[u.value for u in Untracked]}, got {untracked!r}") from None
        try:  # what the resume does with a tracked data loader saved with another batch size (data.check_loaders)
            self.rebatch = Rebatch(rebatch)
        except ValueError:
            raise ConfigError(f"rebatch must be one of {[r.value for r in Rebatch]}, got {rebatch!r}") from None
        self.last_saved: Manifest | None = None
        self.refused = False  # ``refuse_untracked`` or ``check_loaders`` refused the resume
        self._fetched: list[Path] = []
        self._hashes: ClosedFileHashes | None = None

    def hash_on_close(self, folder: Path | None) -> None:
        """Hash each file the trainer closes in ``folder`` (created) from now on, on a thread, for the next
        ``commit`` (which stops it; None: stop now). Only on a rank that stores what it finds there."""
        if self._hashes is not None:
            self._hashes.close()
        self._hashes = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)  # watched before the trainer's first file
            self._hashes = ClosedFileHashes(folder, sync=self.storage.links_files)

    def commit(
        self,
        step: int,
        folder: str | Path,
        reason: str,
        deadline: float | None = None,
        extra: dict[str, Any] | None = None,
        supersede: bool = False,
    ) -> Manifest | None:
        """Store ``folder`` as checkpoint ``step`` (manifest last) and prune (not after an emergency save);
        None when already committed.
        ``supersede``: a committed checkpoint of ``step`` holds another state; this one replaces it, as the
        step's next revision (``step-N.rK/``): the old one stays the resume point until this one is
        committed, and ``prune`` deletes it then.

        Files ``hash_on_close`` hashed as the trainer closed them are not hashed again. Collective in a
        process group: every rank passes its own folder (see ``folders.commit``)."""
        t0 = time.monotonic()
        self._hold()
        self._tidy.claim(step)  # this save replaces what a killed one of its step left
        agreed = self.group.get()
        if agreed is None:
            revision = layout.next_revision(self.storage, step) if supersede else 0
            write = functools.partial(checkpoint.write_dir, self.storage, revision=revision, fence=self.lease.fence)
        else:
            write = functools.partial(folders.commit, self.storage, agreed, supersede=supersede, fence=self.lease.fence)
        known = self._hashes.known if self._hashes is not None else None
        try:
            manifest = write(
                step,
                Path(folder),
                reason=reason,
                extra=extra,
                torch_version=torch.__version__,
                deadline=deadline,
                known=known,
            )
        except CheckpointExistsError:
            logger.info("%s is already committed", self.storage.describe(checkpoint.step_dir(step)))
            return None
        except LeaseHeldError:  # LeaseLostError: another job took the run over; nothing was committed
            self._lease_lost("")
            raise
        finally:
            self.hash_on_close(None)
        self.last_saved = manifest  # (after a stop's last checkpoint NoticeWatch.stop_saved releases the lease)
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
        if self.group.rank != 0 or reason == "emergency":
            return manifest  # rank 0 prunes for all; never on a deadline's clock (the next commit prunes)
        try:
            self._tidy.after_commit(self.storage, step)
        except Exception as e:
            logger.warning("pruning old checkpoints in %s failed: %s", self.storage.describe(), e)
        return manifest

    def newest_verified(self, rank_files: RankFiles | None = None) -> tuple[int, Path] | None:
        """The newest checkpoint whose files all match their manifest, as a local folder, and its step.

        Folders without a manifest (a save cut short), or whose files fail their checksums, are
        skipped with a warning naming the reason, and the previous one is tried; a newer spotguard's
        checkpoint raises ``CheckpointFormatError`` (upgrade spotguard). Collective in a process
        group: the same step on every rank, one verified copy per node (``folders.fetch``), holding
        the shared files and the node's own ranks' files (``rank_files``: the trainer's rule; None: all).
        Saves killed mid-write go as the Guard's do (``retention.Housekeeping``), by rank 0.
        """
        listed: list[CheckpointInfo] = []  # this process's listing, when it made one (no process group)
        found = self._newest_verified(rank_files, listed)
        if found is not None and self.group.rank == 0:
            try:
                self._tidy.at_resume([(self.storage, listed or checkpoint.scan(self.storage))], found[0])
            except Exception as e:  # housekeeping never fails a resume
                logger.warning("cannot list %s for unfinished saves: %s", self.storage.describe(), e)
        return found

    def _newest_verified(self, rank_files: RankFiles | None, listed: list[CheckpointInfo]) -> tuple[int, Path] | None:
        self._hold()
        agreed = self.group.get()
        if agreed is not None:
            found = folders.fetch(self.storage, agreed, self.work_dir, rank_files, fresh_ok=self.fresh_ok)
            if found is not None and folders.is_node_leader():
                self._fetched.append(found[1])
            return found
        skipped: list[str] = []
        listed[:] = checkpoint.scan(self.storage)
        for info in reversed(listed):
            where = self.storage.describe(info.name)
            refuse_newer_format(self.storage, info)  # a newer spotguard's: upgrade, never fall back past it
            if not info.complete:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                if info.status != "incomplete":  # a save cut short is no lost work; a corrupt one is
                    skipped.append(f"{where}: {info.status} ({info.problem})")
                continue
            if self.work_dir:
                Path(self.work_dir).mkdir(parents=True, exist_ok=True)
            dest = Path(tempfile.mkdtemp(prefix=f"spotguard-{info.name}-", dir=self.work_dir))
            try:
                checkpoint.fetch(self.storage, info, dest)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                skipped.append(f"{where}: {e}")
                shutil.rmtree(dest, ignore_errors=True)
                mark_corrupt(self.storage, info, e)
                continue
            self._fetched.append(dest)
            logger.info(
                "resuming from %s (step %d, %s)", where, info.step, info.manifest.reason if info.manifest else "?"
            )
            return info.step, dest
        if skipped and not self.fresh_ok:
            raise none_loads(self.storage, skipped)
        logger.log(
            logging.WARNING if skipped else logging.INFO,
            "no checkpoint that loads in %s: starting from the beginning",
            self.storage.describe(),
        )
        return None

    def refuse_untracked(self, saved: Iterable[str], tracked: Iterable[str], where: str, fix: str) -> None:
        """``state.refuse_untracked`` with the integration's ``untracked`` option (``refusing``)."""
        with self.refusing():
            state.refuse_untracked(saved, tracked, where, self.untracked, fix)

    def check_loaders(
        self,
        loaders: Mapping[str, Any],
        states: MutableMapping[str, Any],
        facts: Mapping[str, Mapping[str, Any]],
        where: str,
    ) -> None:
        """``data.check_loaders`` with the integration's ``rebatch`` option (``refusing``): the Guard's checks
        of a tracked loader's worker count and batch size. Call before the trainer loads ``states`` (a
        state moved to the new worker count is rewritten there)."""
        with self.refusing():
            data.check_loaders(loaders, states, facts, where, self.rebatch)

    @contextmanager
    def refusing(self) -> Iterator[None]:
        """A resume check: its refusal (``CheckpointMismatchError``) marks the heartbeat, so that ``spotguard
        run`` exits 78 instead of restarting into the same refusal, and ``refused`` (the trainer's own
        wrapper, ``cb.fit``, returns ``EXIT_CONFIG`` then)."""
        try:
            yield
        except CheckpointMismatchError as e:
            self.refused = True
            self._beat.permanent(e)
            raise

    def _hold(self) -> None:
        """The run's writer lease, before the first load or commit (collective in a process group)."""
        self.lease.agreement = self.group.get()
        try:
            self.lease.hold()
        except LeaseHeldError:
            self._lease_lost("")
            raise

    def _lease_lost(self, why: str) -> None:
        self._beat.lease_held()  # `spotguard run` exits 73, no restart

    def release(self) -> None:
        """This job writes nothing more here: the next job on the storage takes the lease at once."""
        self.lease.release()

    def loaded(self) -> None:
        """After the trainer loaded the fetched copy on every rank: remove it. Collective in a process
        group (a barrier first: the ranks of a node share one copy)."""
        agreed = self.group.get()
        if agreed is not None:
            agreed.reduce(0, agreed.save_group)
        self.cleanup()

    def adopt(self, path: Path) -> None:
        """Remove ``path`` too at ``cleanup``: a fetched copy moved there."""
        self._fetched.append(path)

    def cleanup(self) -> None:
        """Remove the local copies fetched for a resume (the trainer has loaded them; in a process
        group, every rank of the node has: call it after a collective that follows the load)."""
        self.hash_on_close(None)
        for path in self._fetched:
            shutil.rmtree(path, ignore_errors=True)
        self._fetched.clear()


def unlink_linked_ahead(output_dir: Path, step: int, prefix: str = "checkpoint-") -> None:
    """Unlink the files with another link in the trainer's folders ``{prefix}N`` of steps past ``step``.

    Why: a local storage stores a trainer's file as a hard link of it (``Storage.links_files``), and a
    run that starts at ``step`` (a new run from 0 in an old run's ``output_dir``) writes those folders
    again, in place, which would rewrite committed checkpoints under their manifests. The storage
    keeps its link; the trainer writes new files. Call it before the first save (no rank writes yet).
    """
    for folder in Path(output_dir).glob(f"{prefix}*"):
        ahead = folder.name[len(prefix) :]
        if not (ahead.isdigit() and int(ahead) > step and folder.is_dir()):
            continue
        for path in folder.rglob("*"):
            try:
                if not path.is_symlink() and path.is_file() and path.stat().st_nlink > 1:
                    path.unlink()
            except OSError as e:  # the trainer's own write then fails the way it would have
                logger.warning("cannot unlink %s before the trainer writes it again: %s", path, e)
