"""Finding and reading checkpoints in a storage: scan, latest, verify, and verified local copies.

A reader trusts nothing but a valid manifest: ``scan`` classifies every ``step-N/`` (complete,
incomplete, corrupt, newer-format) without reading file contents; ``open_verified`` checks a file's size and
checksum before handing out its local path, so a flipped byte is caught before anything loads it
(``open_verifying``: while the caller reads it, for a resume that reads and checks in one pass).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from spotguard.checkpoint.format import bounds
from spotguard.checkpoint.format.manifest import (
    MANIFEST,
    NEWER_FORMAT,
    CheckpointInfo,
    Manifest,
    dir_order,
    parse_step_dir,
)
from spotguard.checkpoint.format.verifying import Verifying
from spotguard.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    ChecksumMismatchError,
    NoLoadableCheckpointError,
    StorageError,
)
from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)


def scan(storage: Storage) -> list[CheckpointInfo]:
    """Every ``step-N/`` directory, oldest first, with its status. Other keys are ignored. Revisions of one
    step (``step-N.rK/``, ``manifest.step_dir``) follow it, the highest last.

    A file missing, or listed with another size than the manifest's, makes the checkpoint corrupt:
    the listing carries the sizes, so a truncated object is caught without reading it (contents
    are checked by ``verify``).
    """
    groups: dict[str, dict[str, int]] = {}
    for key, size in storage.list_sizes("").items():
        top, _, rest = key.partition("/")
        if rest and parse_step_dir(top) is not None:
            groups.setdefault(top, {})[rest] = size
    return _classify(storage, groups)


def scan_one(storage: Storage, name: str) -> CheckpointInfo | None:
    """``scan`` of the one folder ``name`` (None when it holds nothing): a judgement made again later."""
    cut = len(name) + 1
    listed = {key[cut:]: size for key, size in storage.list_sizes(name + "/").items()}
    found = _classify(storage, {name: listed} if listed and parse_step_dir(name) is not None else {})
    return found[0] if found else None


def _classify(storage: Storage, groups: dict[str, dict[str, int]]) -> list[CheckpointInfo]:
    """Each folder (name -> its files' sizes) with its status, oldest first."""
    infos = []
    for name in sorted(groups, key=dir_order):  # a step's later revision after it: the newest is last
        step = parse_step_dir(name) or 0
        if MANIFEST not in groups[name]:
            infos.append(CheckpointInfo(step, name, "incomplete", problem="no manifest"))
            continue
        broken = False
        try:
            if groups[name][MANIFEST] > bounds.MAX_BYTES:  # refused before it is downloaded
                raise CheckpointCorruptError(
                    f"{name}: invalid manifest ({groups[name][MANIFEST]} bytes, more than {bounds.MAX_BYTES})"
                )
            manifest = Manifest.from_bytes(storage.get_bytes(f"{name}/{MANIFEST}"), where=name)
            if manifest.step != step:
                raise CheckpointCorruptError(f"{name}: manifest says step {manifest.step}")
            problem = listing_problem(name, manifest, groups[name])
            if problem:
                broken = True
                raise CheckpointCorruptError(problem)
        except CheckpointFormatError as e:  # a newer spotguard's: neither corrupt nor readable here
            infos.append(CheckpointInfo(step, name, NEWER_FORMAT, problem=str(e)))
            continue
        except CheckpointCorruptError as e:
            infos.append(CheckpointInfo(step, name, "corrupt", problem=str(e), broken=broken))
            continue
        except StorageError as e:
            infos.append(CheckpointInfo(step, name, "corrupt", problem=f"{name}: unreadable manifest ({e})"))
            continue
        infos.append(CheckpointInfo(step, name, "complete", manifest))
    return infos


#: Left in a committed checkpoint whose bytes a resume found unlike its manifest (``mark_corrupt``).
CORRUPT_MARK = "corrupt.json"


def listing_problem(name: str, manifest: Manifest, listed: Mapping[str, int]) -> str:
    """Why the listing of a committed checkpoint (file name -> size) does not match its manifest, or "".

    A file missing or of another size, or a resume's ``CORRUPT_MARK``, is corrupt for good
    (``CheckpointInfo.broken``): no retry mends it.
    """
    if CORRUPT_MARK in listed and all(f.name != CORRUPT_MARK for f in manifest.files):
        return (
            f"{name}: a resume found it unlike its manifest ({name}/{CORRUPT_MARK}; delete that file to try it again)"
        )
    missing = [f.name for f in manifest.files if f.name not in listed]
    if missing:
        return f"{name}: missing file(s) {', '.join(missing)}"
    for f in manifest.files:
        if listed[f.name] != f.size:
            return f"{name}/{f.name}: {listed[f.name]} bytes, the manifest says {f.size}"
    return ""


def latest(storage: Storage) -> CheckpointInfo | None:
    """The newest checkpoint whose manifest is valid (file contents not yet verified).

    Raises ``CheckpointFormatError`` when a newer spotguard wrote a later step: an older
    checkpoint is not the newest one, and using it would lose the work since.
    """
    infos = [i for i in scan(storage) if i.complete or i.status == NEWER_FORMAT]
    if infos:
        refuse_newer_format(storage, infos[-1])
    return infos[-1] if infos else None


def refuse_newer_format(storage: Storage, info: CheckpointInfo) -> None:
    """Raise ``CheckpointFormatError`` when ``info``, the newest candidate of a resume, is of a newer format.

    Unlike a corrupt checkpoint it is not skipped: its state is fine, only this version cannot
    read it, and falling back to an older one would silently redo (or lose) the steps since.
    """
    if info.status == NEWER_FORMAT:
        raise CheckpointFormatError(
            f"{storage.describe()}: the newest checkpoint {info.problem}. "
            "Older checkpoints are not used in its place: that would lose the work since."
        )


def none_loads(storage: Storage, skipped: list[str]) -> NoLoadableCheckpointError:
    """The error of a resume that found checkpoints (``skipped``: each one and why) but could load none."""
    return NoLoadableCheckpointError(
        f"{storage.describe()} holds {len(skipped)} checkpoint(s) and none of them loads: "
        + "; ".join(skipped)
        + ". Starting again from step 0 would silently redo their work, so resume() stops. Fix the cause (a "
        "class refused by torch.load(weights_only=True): torch.serialization.add_safe_globals([...]) before "
        "resume(), if it is safe to unpickle), or start from step 0 on purpose with Guard(..., on_unloadable='fresh')",
        tuple(skipped),
    )


def require_manifest(info: CheckpointInfo) -> Manifest:
    """The manifest of a complete checkpoint; else the error its status calls for."""
    if info.status == NEWER_FORMAT:
        raise CheckpointFormatError(info.problem)
    if info.manifest is None:
        problem = info.problem or info.status
        raise CheckpointCorruptError(problem if problem.startswith(info.name) else f"{info.name}: {problem}")
    return info.manifest


@contextmanager
def open_verified(storage: Storage, info: CheckpointInfo, fname: str) -> Iterator[Path]:
    """A local path to one file of a checkpoint, after its size and checksum matched the manifest.

    Verifying reads the whole file (chunks hashed on several threads), which leaves it in the
    page cache for the caller's load.
    """
    with open_verifying(storage, info, fname) as (path, check):
        check.result()
        yield path


@contextmanager
def open_verifying(storage: Storage, info: CheckpointInfo, fname: str) -> Iterator[tuple[Path, Verifying]]:
    """A local path to one file of a checkpoint whose size matched the manifest, and the check of its
    checksum (running from ``check.start()``): the caller reads while it runs and keeps nothing before
    ``check.result()``."""
    entry = next((f for f in require_manifest(info).files if f.name == fname), None)
    if entry is None:
        raise CheckpointCorruptError(f"{info.name}: manifest does not list {fname}")
    with storage.local_copy(f"{info.name}/{fname}") as path:
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointCorruptError(f"{info.name}/{fname}: size {size} != {entry.size} in manifest")
        check = Verifying(path, entry, f"{info.name}/{fname}")
        try:
            yield path, check
        finally:
            check.close()


def mark_corrupt(storage: Storage, info: CheckpointInfo, error: Exception) -> None:
    """Leave ``CORRUPT_MARK`` in ``info``, whose bytes a resume found unlike its manifest. Why: its listing
    still looks committed, so retention counted it among the ``keep`` (the newest, too) and deleted good
    ones in its place (every one, with ``keep=1``), and a save of its step was refused as already
    committed. Marked, it is broken for good: not counted, pruned once older than the newest good one,
    replaced by a save of its step; nothing of it is deleted here. A failure is logged, never raised.

    Only a ``ChecksumMismatchError`` that a second, fresh read of the checkpoint confirms: a load that
    fails (``weights_only``, another torch), a read cut short or a transfer fault says nothing of its bytes.
    """
    if not isinstance(error, ChecksumMismatchError):
        return
    try:
        verify(storage, info)
    except ChecksumMismatchError as again:
        error = again
    except Exception as e:
        logger.warning("%s not marked corrupt: reading it again failed (%s)", storage.describe(info.name), e)
        return
    else:
        logger.warning("%s not marked corrupt: read again, it matched its manifest", storage.describe(info.name))
        return
    record = {"problem": str(error), "marked_at": time.time()}
    try:
        storage.put_bytes(f"{info.name}/{CORRUPT_MARK}", json.dumps(record).encode())
    except Exception as e:  # housekeeping: never fails a resume, which goes on to an older checkpoint
        logger.warning("cannot mark %s corrupt: %s", storage.describe(info.name), e)
        return
    logger.warning(
        "marked %s corrupt (%s): it no longer counts among the checkpoints kept", storage.describe(info.name), error
    )


def verify(storage: Storage, info: CheckpointInfo) -> None:
    """Check every file of a checkpoint against its manifest; raise ``CheckpointCorruptError``
    (``CheckpointFormatError`` for a checkpoint of a newer spotguard)."""
    for entry in require_manifest(info).files:
        with open_verified(storage, info, entry.name):
            pass


def fetch(storage: Storage, info: CheckpointInfo, dest: Path, select: Callable[[str], bool] | None = None) -> Path:
    """Every file of a complete checkpoint (those ``select`` accepts), verified, in the local folder
    ``dest`` (created); returns it.

    For libraries that load a checkpoint folder themselves (``Trainer``'s ``resume_from_checkpoint``).
    A file is hard-linked where it can be (a local checkpoint, a download's temp file), else copied.
    """
    manifest = require_manifest(info)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest.files:
        if select is not None and not select(entry.name):
            continue
        target = dest / entry.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        with open_verified(storage, info, entry.name) as path:
            try:
                os.link(path, target)
            except OSError:
                shutil.copyfile(path, target)
    return dest
