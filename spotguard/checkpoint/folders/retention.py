"""Which checkpoints go, and how one goes: ``prune`` keeps the newest, ``delete`` removes one, manifest first,
``drop_killed_saves`` removes what saves killed mid-write left; ``Housekeeping`` runs both after a commit.

Deleting runs the other way round from writing: the manifest first, so a half-deleted checkpoint is
never mistaken for a whole one. Split from ``layout`` (how a checkpoint is written and copied).
"""

from __future__ import annotations

import logging
import threading

from spotguard.checkpoint.format.manifest import MANIFEST, CheckpointInfo, dir_order, parse_step_dir, step_dir
from spotguard.checkpoint.format.reader import scan
from spotguard.errors import ConfigError
from spotguard.storage.base import Storage, check_key

logger = logging.getLogger(__name__)


def delete(storage: Storage, name: str) -> None:
    """Delete one checkpoint directory, manifest first."""
    if parse_step_dir(name) is None:
        raise ConfigError(f"not a checkpoint name: {name!r}")
    keys = deletable(storage, storage.list(name + "/"))
    manifest = f"{name}/{MANIFEST}"
    if manifest in keys:
        storage.delete([manifest])
    storage.delete([k for k in keys if k != manifest])


def deletable(storage: Storage, keys: list[str]) -> list[str]:
    """``keys`` but those no storage call takes (``check_key``: an empty component, as in the ``step-N/``
    "folder" an S3 or GCS console makes, or ``step-N//x``). Such a key in a folder made housekeeping raise
    ``ConfigError``, which failed every resume for good; it is left, with a warning."""
    ok, odd = [], []
    for key in keys:
        try:
            ok.append(check_key(key))
        except ConfigError:
            odd.append(key)
    if odd:
        logger.warning(
            "leaving %s: spotguard does not delete keys with an empty component (%s); remove them with "
            "the storage's own tools",
            storage.describe(odd[0].split("/")[0]),
            ", ".join(repr(k) for k in odd[:5]),
        )
    return ok


def prune(
    storage: Storage, keep: int, infos: list[CheckpointInfo] | None = None, skip: frozenset[str] = frozenset()
) -> list[int]:
    """Delete complete checkpoints beyond the newest ``keep``; returns the deleted steps.

    ``skip``: names of complete checkpoints this run's resume could not load (above its resume point):
    neither counted among the ``keep`` nor deleted. Counted, one that never loads would hold a place as
    the newest while the checkpoints the run writes below its step are pruned, its resume point first.

    Only directories carrying a valid spotguard manifest are ever deleted: incomplete ones are left
    for ``spotguard rm --incomplete`` (or replaced when their step is saved again), and so are
    checkpoints of a newer spotguard (newer-format), which do not count among the ``keep`` either.
    Of the corrupt ones only those corrupt for good (``broken``: the manifest names a file that is
    missing or of another size) and older than the newest complete checkpoint go: resume would
    skip them, and nothing mends them. One whose manifest cannot be read or parsed is kept (a
    passing fault, or something to look at). A revision of a step below its highest complete one
    (``step_dir``) is superseded: it goes, complete, incomplete or broken (no writer returns to it),
    and does not count among the ``keep``.
    """
    if keep < 1:
        raise ConfigError("keep must be at least 1: the newest complete checkpoint is never deleted")
    infos = scan(storage) if infos is None else infos
    newest = {i.step: i.revision for i in infos if i.complete}  # scan's order: the highest revision last
    superseded = {
        i.name
        for i in infos
        if i.revision < newest.get(i.step, -1) and (i.complete or i.broken or i.status == "incomplete")
    }
    complete = [i for i in infos if i.complete and i.name not in superseded and i.name not in skip]
    doomed = complete[:-keep] + [i for i in infos if i.name in superseded]
    if complete:
        doomed += [i for i in infos if i.broken and i.step < complete[-1].step and i.name not in superseded]
    doomed.sort(key=lambda i: dir_order(i.name))
    for info in doomed:
        delete(storage, info.name)
        logger.debug("pruned %s%s", storage.describe(info.name), f" ({info.problem})" if info.broken else "")
    return [i.step for i in doomed]


def drop_killed_saves(storage: Storage, infos: list[CheckpointInfo], upto: int) -> None:
    """Delete the incomplete ``step-N/`` (or ``step-N.rK/``) of ``infos`` at or below step ``upto``: saves
    killed mid-write, that nothing will replace. The caller vouches that no writer of this run is at them
    (``Housekeeping.claim``); one committed since the listing is kept all the same, as are corrupt ones. A
    failure is logged, never raised.
    """
    for info in infos:
        if info.status != "incomplete" or info.step > upto:
            continue
        try:
            keys = storage.list(info.name + "/")
            if f"{info.name}/{MANIFEST}" in keys:  # committed since it was listed: a checkpoint, not garbage
                continue
            storage.delete(deletable(storage, keys))
            logger.info("removed %s: an unfinished save (%s)", storage.describe(info.name), info.problem)
        except (OSError, ConfigError) as e:  # StorageError included: housekeeping never fails a resume or a save
            logger.warning("cannot remove unfinished save %s: %s", storage.describe(info.name), e)


class Housekeeping:
    """What a run removes after each commit, from one listing: checkpoints beyond ``keep``, and the saves
    killed mid-write that its resume found, as soon as nothing can replace them: those at or below the
    resume point at once (the run goes on past them), those above once it has committed past them (a save
    it skips, or one on another interval, would not replace them), unless this run has started a save of
    their step since (``claim``: that save replaces them). The single-process engine calls it for each
    tier, the sharded one on rank 0 (and on every rank to name a save's directory: ``supersede``), the trainer
    integrations on rank 0; from the loop's thread and the background writer's alike (a lock)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._ahead: list[tuple[Storage, list[CheckpointInfo]]] = []
        self._unloadable: list[tuple[Storage, list[CheckpointInfo]]] = []  # complete, above the resume point
        self._revisions: dict[int, int] = {}  # ``supersede``: step -> the revision its saves take
        self._lock = threading.Lock()

    def at_resume(self, tiers: list[tuple[Storage, list[CheckpointInfo]]], step: int) -> None:
        """The resume loaded ``step``; ``tiers``: each storage with what it listed before this run wrote."""
        with self._lock:
            for tier, infos in tiers:
                drop_killed_saves(tier, infos, step)
            self._ahead = [
                (tier, [i for i in infos if i.status == "incomplete" and i.step > step]) for tier, infos in tiers
            ]
            self._unloadable = [(tier, [i for i in infos if i.complete and i.step > step]) for tier, infos in tiers]

    def unloadable(self, storage: Storage, step: int) -> bool:
        """Whether ``storage`` held a complete checkpoint of ``step`` that the resume skipped (it did not load):
        a save of that step supersedes it (its next revision), never is refused as "already committed"."""
        with self._lock:
            return any(tier is storage and i.step == step for tier, infos in self._unloadable for i in infos)

    def supersede(self, infos: list[CheckpointInfo], step: int) -> None:
        """The resume loaded ``step`` (0: none loads, a fresh start) from ``infos``, its listing: a save of the
        step of a checkpoint above it, which did not load, is written as that step's next revision
        (``dir_for``), which supersedes it once committed (``prune``), never refused as "already committed".
        Every rank of a collective resume calls it with the same listing: their saves agree on the name."""
        revisions: dict[int, int] = {}
        for i in infos:
            if i.step > step and i.status != "incomplete":  # it holds a manifest: a save must not land on it
                revisions[i.step] = max(revisions.get(i.step, 0), i.revision + 1)
        with self._lock:
            self._revisions = revisions

    def dir_for(self, step: int) -> str:
        """The directory a collective save of ``step`` writes: ``step_dir(step)``, or its revision (``supersede``)."""
        with self._lock:
            return step_dir(step, self._revisions.get(step, 0))

    def claim(self, step: int) -> None:
        """A save of ``step`` starts: what a killed save of that step left is its writer's to replace now."""
        with self._lock:
            for _, infos in self._ahead:
                infos[:] = [i for i in infos if i.step != step]

    def after_commit(self, storage: Storage, step: int) -> None:
        """``step`` is committed to ``storage``: prune it, and drop a remembered save at or below ``step``
        that is still incomplete (one saved again since is complete, and stays). Raises what the storage raises."""
        with self._lock:
            now = scan(storage)
            skip = {i.name for tier, infos in self._unloadable if tier is storage for i in infos if i.step > step}
            prune(storage, self.keep, now, frozenset(skip))  # counted again once this run has passed them
            for tier, infos in self._ahead:
                if tier is storage and infos:
                    names = {i.name for i in infos}
                    drop_killed_saves(tier, [i for i in now if i.name in names], step)
                    infos[:] = [i for i in infos if i.step > step]
