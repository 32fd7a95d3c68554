"""The layout of one checkpoint, and how it is written and copied (``retention``: how one goes).

``<root>/step-00000100/`` holds the state file(s) and ``manifest.json``. The manifest is written
last, write-once, and lists every file with its size and checksum (BLAKE3 per 16 MiB chunk, see
``checkpoint.format.digest``; SHA-256 in older manifests): a directory without a valid
manifest is not a checkpoint (the commit-marker idea of torchsnapshot and Orbax). Deleting goes the
other way round: manifest first, so a half-deleted checkpoint is never mistaken for a whole one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from spotguard.checkpoint.files import filewrite
from spotguard.checkpoint.files.fileio import WorkMeter
from spotguard.checkpoint.files.filewrite import Writer
from spotguard.checkpoint.folders.fence import Fence, fence_first, fenced
from spotguard.checkpoint.folders.retention import deletable, delete
from spotguard.checkpoint.format import digest
from spotguard.checkpoint.format.manifest import (
    MANIFEST,
    REASONS,
    CheckpointInfo,
    FileEntry,
    Manifest,
    check_file_name,
    dir_order,
    parse_step_dir,
    step_dir,
)
from spotguard.checkpoint.format.reader import listing_problem, open_verified, require_manifest
from spotguard.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointFormatError,
    ConfigError,
    SaveCancelled,
    StorageError,
)
from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)
STORERS = 4  # files stored at once by ``store_files``


def write(
    storage: Storage,
    step: int,
    files: Mapping[str, Writer],
    *,
    reason: str,
    extra: Mapping[str, Any] | None = None,
    world_size: int = 1,
    torch_version: str = "",
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    replace: bool = False,
    on_content: Callable[[tuple[FileEntry, ...]], None] | None = None,
    upload_crc: Callable[[Any, Any], Any] | None = None,
    crcs: dict[str, Any] | None = None,
    meter: WorkMeter | None = None,
    fence: Fence | None = None,
) -> Manifest:
    """Write one checkpoint: each file serialised locally, hashed, stored; then the manifest, write-once.

    Files are serialised to a scratch directory the backend chooses (beside the target for local storage,
    so storing is a hard link) through a ``DirectFile``: written once, past the page cache, hashed on the
    way, so that a background save takes little CPU from the loop and an upload never waits on a slow
    stream. A complete checkpoint for ``step`` already there raises
    ``CheckpointExistsError``; leftovers of an interrupted save of the same step are deleted first.
    ``cancel``, when set, abandons the save within one write buffer (``DirectFile``), or before the
    next file or the manifest.

    ``replace=True`` (the final checkpoint) never lets two contents share a step: every file is
    serialised and hashed first, then ``on_content(entries)`` is called; a committed checkpoint of
    ``step`` with the same files and ``extra`` is kept as it is (``CheckpointExistsError``: nothing
    to write); one that differs is superseded, never deleted first: the new content is committed as the
    step's next revision (``next_revision``), ``prune`` deletes the old one once that has landed.

    ``upload_crc`` (the durable storage's, when ``storage`` is a local tier copied to it) is kept while each
    file is written, in ``crcs`` (name -> CRC) for ``copy(crcs=)``; by default ``storage``'s own (``put_file``).

    ``meter`` adds up what the files cost apart from waiting for a CPU (``DirectFile.work_seconds``);
    a streamed upload's network time is not in it (its rate is the wall time's). ``fence``: the writer
    lease's, called before leftovers are deleted and just before the manifest (``_commit``).
    """
    if reason not in REASONS:
        raise ConfigError(f"reason must be one of {REASONS}, got {reason!r}")
    name = step_dir(step)
    try:
        extra_json = json.loads(json.dumps(dict(extra or {})))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"guard.extra must be JSON-serialisable: {e}") from e
    for fname in files:
        check_file_name(fname)
    _clear_leftovers(storage, name, replace, fence)
    entries: list[FileEntry] = []
    held: list[tuple[str, Path, Any]] = []  # replace=True: stored only once the content is known
    with storage.scratch() as scratch:
        for i, (fname, writer) in enumerate(files.items()):
            written = filewrite.write(
                storage,
                f"{name}/{fname}",
                fname,
                writer,
                scratch / f"{i}-{fname.replace('/', '_')}",
                deadline=deadline,
                cancel=cancel,
                upload_crc=upload_crc,
                meter=meter,
                stream=not replace,
            )
            entries.append(written.entry)
            own_crc = written.crc if upload_crc is None else None
            if crcs is not None and written.crc is not None:
                crcs[fname] = written.crc
            if replace:
                held.append((fname, written.path, own_crc))
            elif not written.stored:
                filewrite.store(storage, f"{name}/{fname}", written.path, deadline, own_crc)
        if replace:
            if on_content is not None:
                on_content(tuple(entries))
            revision = next_revision(storage, step)  # 0: nothing of this step is committed
            if revision and _drop_broken(storage, step_dir(step, revision - 1)):  # corrupt for good: replaced
                revision = next_revision(storage, step)
            if revision:  # committed (its newest revision): the new content supersedes it, never deletes it first
                newest = step_dir(step, revision - 1)
                old = _committed_manifest(storage, newest)
                if old is not None and old.files == tuple(entries) and old.extra == extra_json:
                    raise CheckpointExistsError(f"{storage.describe(newest)} is already committed with this content")
                name = step_dir(step, revision)
                logger.info(
                    "replacing %s (%s) with %s: the state at step %d has changed since",
                    storage.describe(newest),
                    old.reason if old else "unreadable",
                    name,
                    step,
                )
                _clear_leftovers(storage, name, fence=fence)  # what a replacement killed before its manifest left
            for fname, path, crc in held:
                filewrite.store(storage, f"{name}/{fname}", path, deadline, crc)
    if cancel is not None and cancel.is_set():
        raise SaveCancelled(f"save of {name} abandoned before its commit")
    manifest = Manifest(
        step, reason, tuple(entries), world_size=world_size, extra=extra_json, torch_version=torch_version
    )
    return _commit(storage, name, manifest, deadline, fence)


def write_dir(
    storage: Storage,
    step: int,
    directory: Path,
    *,
    reason: str,
    extra: Mapping[str, Any] | None = None,
    world_size: int = 1,
    torch_version: str = "",
    deadline: float | None = None,
    revision: int = 0,
    fence: Fence | None = None,
    known: Known | None = None,
) -> Manifest:
    """Commit a folder another library wrote (a trainer's own checkpoint) as checkpoint ``step``.

    Trainers write their checkpoint folders file by file, with no commit marker and no checksums:
    a folder cut short by a kill looks like a checkpoint. Here every regular file below
    ``directory`` is hashed and stored under ``step-N/`` with its relative path, and the manifest
    is written last, so the folder obeys the same rules as ``write``. The files must not change
    afterwards: local storage hard-links them when it can. ``revision`` > 0: as ``step-N.rK/``, which
    supersedes the step's lower revisions (``next_revision``; ``prune`` deletes them). ``known``: digests
    taken as the files were closed (``store_files``).
    """
    if reason not in REASONS:
        raise ConfigError(f"reason must be one of {REASONS}, got {reason!r}")
    name = step_dir(step, revision)
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"cannot commit {root}: not a directory")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    if not paths:
        raise ConfigError(f"cannot commit {root}: it holds no files")
    files = {p.relative_to(root).as_posix(): p for p in paths}
    for fname in files:
        check_file_name(fname)
    try:
        extra_json = json.loads(json.dumps(dict(extra or {})))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"extra must be JSON-serialisable: {e}") from e
    _clear_leftovers(storage, name, fence=fence)
    entries = store_files(storage, name, files, deadline, known)
    manifest = Manifest(
        step, reason, tuple(entries), world_size=world_size, extra=extra_json, torch_version=torch_version
    )
    return _commit(storage, name, manifest, deadline, fence)


#: A digest taken earlier, if still valid: (local path, algorithm) -> digest or None (``ClosedFileHashes.known``).
Known = Callable[[Path, str], "str | None"]


def store_files(
    storage: Storage, name: str, files: Mapping[str, Path], deadline: float | None, known: Known | None = None
) -> list[FileEntry]:
    """Hash and store files another library wrote (checkpoint file name -> local path) under ``name``.

    The stores (an fsync of each file, or its upload) run on helper threads while this one hashes: a trainer's
    emergency save pays about the longer of the two, not their sum. A file ``known`` has a digest of (hashed as
    its writer closed it, unchanged since) is not hashed again. Read, not mapped: a rewrite kills a map's reader."""
    alg = digest.default_alg()

    def hashed(p: Path) -> str:
        return (known and known(p, alg)) or digest.read_file_digest(p, digest.CHUNK, alg=alg)

    with ThreadPoolExecutor(STORERS, thread_name_prefix="spotguard-store") as pool:
        stored = [pool.submit(storage.put_file, f"{name}/{f}", p, deadline=deadline) for f, p in files.items()]
        try:
            entries = [FileEntry(f, p.stat().st_size, hashed(p), digest.CHUNK, alg) for f, p in files.items()]
        finally:
            for fut in stored:
                fut.result()  # the first store that failed raises
    return entries


def _commit(storage: Storage, name: str, manifest: Manifest, deadline: float | None, fence: Fence | None) -> Manifest:
    """Write the manifest, write-once: ``name`` is a checkpoint then (a lost lease's ``fence`` raises first)."""
    deadline = fenced(fence, deadline)
    storage.put_bytes(f"{name}/{MANIFEST}", manifest.to_bytes(), exclusive=True, deadline=deadline)
    return manifest


def _clear_leftovers(storage: Storage, name: str, replace: bool = False, fence: Fence | None = None) -> bool:
    """Refuse a committed ``name`` (unless ``replace``); delete what an interrupted save left, once ``fence``
    says this writer still holds the run (else they may be the new holder's save in progress). Whether committed."""
    existing = storage.list(name + "/")
    committed = f"{name}/{MANIFEST}" in existing
    if committed and _drop_broken(storage, name):
        committed, existing = False, []
    if committed and not replace:
        raise CheckpointExistsError(f"{storage.describe(name)} is already committed")
    if existing and not committed:
        fence_first(fence)
        logger.info("replacing %d leftover file(s) of an interrupted save in %s", len(existing), storage.describe(name))
        storage.delete(deletable(storage, existing))
    return committed


def next_revision(storage: Storage, step: int) -> int:
    """The revision a new checkpoint of ``step`` takes to supersede the committed ones (``step_dir``):
    one above the highest that holds a manifest. Only the step's own keys are listed: no manifest is read."""
    committed = [
        dir_order(top)[1]
        for key in storage.list(step_dir(step))  # also lists step-N.rK/ (and nothing of another step)
        for top, _, rest in [key.partition("/")]
        if rest == MANIFEST and parse_step_dir(top) == step
    ]
    return max(committed) + 1 if committed else 0


def prepare(storage: Storage, name: str, fence: Fence | None = None) -> str:
    """Rank 0 of a collective save, before any rank stores a file: "exists" when ``name`` is committed, "ok"
    once leftovers of an interrupted save are cleared (``_clear_leftovers``, ``fence`` first), else why it
    cannot be written (a string, for every rank to agree on: never raises)."""
    try:
        _clear_leftovers(storage, name, fence=fence)
    except CheckpointExistsError:
        return "exists"
    except Exception as e:
        return f"rank 0 cannot prepare {storage.describe(name)}: {type(e).__name__}: {e}"
    return "ok"


def _drop_broken(storage: Storage, name: str) -> bool:
    """Delete ``name`` when it is committed but corrupt for good (its manifest names a file that is
    missing or of another size: ``reader.listing_problem``), so that its step can be saved again;
    True when it did. Without this a save of that step would be refused as "already committed"."""
    try:
        manifest = _committed_manifest(storage, name)
    except CheckpointFormatError:  # a newer spotguard's: not ours to judge
        return False
    if manifest is None:  # unreadable or unparseable: not judged here
        return False
    cut = len(name) + 1
    problem = listing_problem(name, manifest, {k[cut:]: v for k, v in storage.list_sizes(name + "/").items()})
    if not problem:
        return False
    logger.warning("replacing %s, corrupt for good: %s", storage.describe(name), problem)
    delete(storage, name)
    return True


def _committed_manifest(storage: Storage, name: str) -> Manifest | None:
    try:
        return Manifest.from_bytes(storage.get_bytes(f"{name}/{MANIFEST}"), where=name)
    except (CheckpointCorruptError, StorageError):
        return None


def copy(
    src: Storage,
    dst: Storage,
    info: CheckpointInfo,
    *,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    verify: bool = False,
    crcs: Mapping[str, Any] | None = None,
    fence: Fence | None = None,
    link: bool = False,
) -> Manifest:
    """Copy a complete checkpoint to another storage (local tier -> durable), manifest last.

    ``crcs``: the ``dst.upload_crc`` of files, kept when they were written (``write(crcs=)``), sent
    with their uploads so that ``dst`` refuses a file damaged since (and none is read twice).

    ``cancel``, when set, abandons the copy before the next file or the manifest. ``verify`` checks each file
    against the manifest on its way (``open_verified``: one read, not a verify then a copy) and raises
    ``CheckpointCorruptError`` before a bad file is stored. ``fence``: the writer lease of ``dst``'s, called
    before leftovers go and just before the manifest. ``link``: a local ``dst`` may hard-link the source's files (the
    engine's tier upload); else each is a copy of its own (``spotguard pull`` linked them: a file rewritten
    in the copy was rewritten in the original too).
    """
    manifest = require_manifest(info)
    existing = dst.list(info.name + "/")
    if f"{info.name}/{MANIFEST}" in existing:
        if not _drop_broken(dst, info.name):
            raise CheckpointExistsError(f"{dst.describe(info.name)} is already committed")
        existing = []
    if existing:
        fence_first(fence)  # as ``_clear_leftovers``
        dst.delete(deletable(dst, existing))
    for entry in manifest.files:
        if cancel is not None and cancel.is_set():
            raise SaveCancelled(f"upload of {info.name} abandoned")
        key, crc = f"{info.name}/{entry.name}", (crcs or {}).get(entry.name)
        own = dst.links_files and src.links_files and not link  # a download is a file of its own already
        with open_verified(src, info, entry.name) if verify else src.local_copy(key) as path:
            with dst.scratch() if own else contextlib.nullcontext(path.parent) as scratch:  # own: beside the target
                filewrite.store(dst, key, Path(shutil.copyfile(path, scratch / "copy")) if own else path, deadline, crc)
    if cancel is not None and cancel.is_set():
        raise SaveCancelled(f"upload of {info.name} abandoned before its commit")
    deadline = fenced(fence, deadline)
    dst.put_bytes(f"{info.name}/{MANIFEST}", manifest.to_bytes(), exclusive=True, deadline=deadline)
    return manifest
