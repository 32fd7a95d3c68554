"""A trainer's checkpoint folder written by several ranks or nodes, committed as one checkpoint.

A trainer in a process group writes its checkpoint collectively: under DDP rank 0 writes the model
and optimizer and every rank its own RNG file; DeepSpeed ZeRO writes one optimizer shard per rank.
Without a shared filesystem each node's folder holds only what its own ranks wrote. The commit
follows the sharded engine's rule (files first, manifest last, after every rank reported), every
step collective on the agreement's save group, in the same order whatever happens:

1. rank 0 checks that the step is not committed and clears leftovers of an interrupted save; its
   verdict is broadcast (this first collective is also the barrier: every rank's trainer save
   has returned, so every file is whole);
2. every rank lists its folder and the lists are gathered; each file goes to the lowest rank that
   has it (on a shared filesystem rank 0 stores them all, on separate nodes each node its own);
3. every rank hashes and stores its files, then every rank reports (error, entries) to all;
4. rank 0 writes the manifest only when every rank succeeded, and broadcasts the outcome.

The resume goes the other way (``fetch``): rank 0 proposes the newest complete checkpoint, local
rank 0 of every node fetches and verifies what its ranks need into a folder of that node (the
shared files and its own ranks' files, by the integration's rule: ``pernode``),
and when any node failed (a corrupt file) all ranks move to the next older checkpoint together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from spotguard.checkpoint.collective import Groups, broadcast
from spotguard.checkpoint.folders import layout, pernode
from spotguard.checkpoint.folders.fence import Fence, fenced
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.manifest import MANIFEST, REASONS, CheckpointInfo, FileEntry, Manifest, check_file_name
from spotguard.checkpoint.format.reader import fetch as fetch_checkpoint
from spotguard.checkpoint.format.reader import mark_corrupt, none_loads, refuse_newer_format, scan
from spotguard.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    ChecksumMismatchError,
    ConfigError,
    LeaseLostError,
    StorageError,
)
from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)


def list_folder(root: Path) -> dict[str, int]:
    """Every regular file below ``root`` (relative posix name -> size); an absent folder is empty."""
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def assign(listings: list[dict[str, int]]) -> dict[str, int]:
    """Which rank stores each file: the lowest rank that has it (file name -> rank)."""
    owners: dict[str, int] = {}
    for rank, files in enumerate(listings):
        for name, size in files.items():
            if name not in owners:
                owners[name] = rank
            elif listings[owners[name]][name] != size:
                logger.warning(
                    "%s differs between rank %d (%d bytes) and rank %d (%d bytes): rank %d's is stored",
                    name,
                    owners[name],
                    listings[owners[name]][name],
                    rank,
                    size,
                    owners[name],
                )
    return owners


def commit(
    storage: Storage,
    groups: Groups,
    step: int,
    folder: Path,
    *,
    reason: str,
    extra: Mapping[str, Any] | None = None,
    torch_version: str = "",
    deadline: float | None = None,
    supersede: bool = False,
    fence: Fence | None = None,
    known: layout.Known | None = None,
) -> Manifest:
    """Collective: commit the folders every rank holds for ``step`` as one checkpoint (module docstring).

    Returns the manifest on every rank. Raises ``CheckpointExistsError`` on every rank when ``step``
    is already committed, ``StorageError`` on every rank when any rank failed (nothing committed),
    ``ConfigError`` when no rank holds a file. ``supersede``: as the step's next revision (rank 0
    picks it, ``layout.next_revision``), which replaces the committed one once it is committed itself.
    ``fence``: rank 0's writer lease's, called before leftovers go and just before the manifest (a lost lease commits nothing).
    ``known``: digests taken as the files were closed (``layout.store_files``).
    """
    if reason not in REASONS:
        raise ConfigError(f"reason must be one of {REASONS}, got {reason!r}")
    group, rank = groups.save_group, groups.rank
    revision, status = 0, ""
    if rank == 0:
        try:
            revision = layout.next_revision(storage, step) if supersede else 0
            status = layout.prepare(storage, layout.step_dir(step, revision), fence)
        except Exception as e:
            status = f"rank 0 cannot list {storage.describe(layout.step_dir(step))}: {type(e).__name__}: {e}"
    revision, status = broadcast((revision, status), group)
    name = layout.step_dir(step, revision)
    if status == "exists":
        raise CheckpointExistsError(f"{storage.describe(name)} is already committed")
    if status != "ok":
        raise StorageError(status)

    error, entries = "", []
    try:
        mine = list_folder(Path(folder))
    except OSError as e:  # reported after the gather: every rank must reach it
        mine, error = {}, f"rank {rank}: cannot list {folder}: {type(e).__name__}: {e}"
    listings: list[Any] = [None] * groups.world_size
    dist.all_gather_object(listings, mine, group=group)
    owners = assign(listings)
    try:
        if error:
            raise StorageError(error)
        if not owners:
            raise ConfigError(f"cannot commit step {step}: no rank holds a file in its checkpoint folder")
        mine_to_store = {n: Path(folder) / n for n in sorted(owners) if owners[n] == rank}
        for fname in mine_to_store:
            check_file_name(fname)
        entries = layout.store_files(storage, name, mine_to_store, deadline, known)
    except StorageError as e:
        error = str(e) if str(e).startswith("rank ") else f"rank {rank}: StorageError: {e}"
    except Exception as e:
        error = f"rank {rank}: {type(e).__name__}: {e}"
    reports: list[Any] = [None] * groups.world_size
    dist.all_gather_object(reports, (error, [dataclasses.astuple(e) for e in entries]), group=group)

    outcome: str | bytes = ""
    if rank == 0:
        failed = [err for err, _ in reports if err]
        if failed:
            outcome = "; ".join(failed)
        else:
            files = sorted((FileEntry(*e) for _, es in reports for e in es), key=lambda f: f.name)
            manifest = Manifest(
                step,
                reason,
                tuple(files),
                world_size=groups.world_size,
                extra=dict(extra or {}),
                torch_version=torch_version,
            )
            try:
                bound = fenced(fence, deadline)  # rank 0 holds the run's lease, if any: a lost one commits nothing
                storage.put_bytes(f"{name}/{MANIFEST}", manifest.to_bytes(), exclusive=True, deadline=bound)
                outcome = manifest.to_bytes()
            except Exception as e:
                outcome = f"rank 0: manifest not written: {type(e).__name__}: {e}"
    outcome = broadcast(outcome, group)
    if isinstance(outcome, str):
        if f"{LeaseLostError.__name__}: " in outcome:
            raise LeaseLostError(f"checkpoint of step {step} not committed: {outcome}")
        if not outcome.startswith("rank 0: manifest") and any(": ConfigError: " in err for err, _ in reports):
            raise ConfigError(outcome)
        raise StorageError(f"checkpoint of step {step} not committed: {outcome}")
    return Manifest.from_bytes(outcome, where=name)


def node_rank() -> int:
    """This process's node, named by the global rank of its local rank 0 (``RANK - LOCAL_RANK``: launchers
    number a node's ranks contiguously); without ``LOCAL_RANK`` every rank is a node of its own."""
    return int(os.environ.get("RANK", 0)) - int(os.environ.get("LOCAL_RANK", 0))


def is_node_leader() -> bool:
    """Whether this rank fetches for its node: ``LOCAL_RANK`` 0, or every rank when no launcher set
    ``LOCAL_RANK`` (each then fetches its own copy: more downloads, never a missing one)."""
    if "LOCAL_RANK" not in os.environ:
        return True
    return int(os.environ["LOCAL_RANK"]) == 0


def node_folder(storage: Storage, step: int, work_dir: str | None) -> Path:
    """Where a node keeps its verified copy of ``step``: the same path for every rank of the node, in
    this user's private folder (``pernode.private_folder``: created, and refused when not ours)."""
    tag = hashlib.sha256(storage.describe().encode()).hexdigest()[:12]
    return pernode.private_folder(work_dir) / f"{tag}-node{node_rank()}-{layout.step_dir(step)}"


def fetch(
    storage: Storage,
    groups: Groups,
    work_dir: str | None = None,
    rank_files: RankFiles | None = None,
    fresh_ok: bool = False,
) -> tuple[int, Path] | None:
    """Collective: the newest checkpoint every node could fetch and verify, as (step, local folder).

    Local rank 0 of each node fetches into ``node_folder`` the files its ranks need: all of them
    without ``rank_files``; with it, all but other ranks' own files (``pernode``). The other ranks of
    the node read the same folder once this returns. A checkpoint whose files fail their checksums
    on any node is skipped by every rank, with a warning, and the next older one tried; a newer
    spotguard's raises ``CheckpointFormatError``. When checkpoints exist but none loads, every rank
    raises ``NoLoadableCheckpointError`` (None with a warning when ``fresh_ok``): starting again from
    step 0 would silently redo their work.
    """
    group, rank = groups.save_group, groups.rank
    # Which ranks share this node's copy, and whether every rank trusts its rule: one gather.
    nodes: list[Any] = [None] * groups.world_size
    dist.all_gather_object(nodes, (_node_key(rank), rank_files.unsure if rank_files else ""), group=group)
    node_ranks = frozenset(r for r, (node, _) in enumerate(nodes) if node == _node_key(rank))
    unsure = [doubt for _, doubt in nodes]
    tried: set[str] = set()  # names: a step's revisions are tried one by one
    skipped: list[str] = []  # corrupt checkpoints (rank 0's list decides)
    while True:
        proposal: Any = None
        if rank == 0:
            try:
                proposal = _propose(storage, tried, skipped)
                if proposal is None and skipped and not fresh_ok:
                    proposal = none_loads(storage, skipped)
            except Exception as e:
                proposal = e
        proposal = broadcast(proposal, group)
        if isinstance(proposal, BaseException):
            raise proposal
        if proposal is None:
            logger.log(
                logging.WARNING if skipped else logging.INFO,
                "no checkpoint that loads in %s: starting from the beginning",
                storage.describe(),
            )
            return None
        info: CheckpointInfo = proposal
        dest = node_folder(storage, info.step, work_dir)
        error = ""
        if is_node_leader():
            try:
                names, why = _selection(info, rank_files, node_ranks, groups.world_size, unsure)
                _fetch_into(storage, info, dest, names, why, node_ranks)
            except ChecksumMismatchError as e:  # "#": bytes unlike the manifest (rank 0 may mark it)
                error = f"#{e}"
            except CheckpointCorruptError as e:
                error = str(e)
            except Exception as e:  # a storage error: every rank raises it, nothing older is tried
                error = f"!{type(e).__name__}: {e}"
        reports: list[Any] = [None] * groups.world_size
        dist.all_gather_object(reports, error, group=group)
        failed = [(r, err) for r, err in enumerate(reports) if err]
        if not failed:
            logger.info("resuming from %s (step %d)", storage.describe(info.name), info.step)
            return info.step, dest
        shutil.rmtree(dest, ignore_errors=True)
        fatal = [f"rank {r}: {err[1:]}" for r, err in failed if err.startswith("!")]
        if fatal:
            raise StorageError(f"cannot fetch {storage.describe(info.name)}: {'; '.join(fatal)}")
        why = "; ".join(f"rank {r}: {err.removeprefix('#')}" for r, err in failed)
        logger.warning("skipping %s: %s", storage.describe(info.name), why)
        if rank == 0 and any(err.startswith("#") for _, err in failed):
            mark_corrupt(storage, info, ChecksumMismatchError(why))
        skipped.append(f"{storage.describe(info.name)}: {why}")
        tried.add(info.name)


def _node_key(rank: int) -> int:
    """Ranks with the same key share one node's copy (``node_folder``); a rank that fetches for itself
    (no ``LOCAL_RANK``) is keyed apart from every node."""
    return node_rank() if "LOCAL_RANK" in os.environ else -1 - rank


def _selection(
    info: CheckpointInfo, rank_files: RankFiles | None, node_ranks: frozenset[int], world: int, unsure: list[str]
) -> tuple[set[str] | None, str]:
    """The names this node fetches (None: every file) and, when every file, why (logged)."""
    if rank_files is None:
        return None, ""
    manifest = info.manifest
    why = pernode.why_everything(manifest.world_size if manifest else 0, world, unsure)
    if why or manifest is None:
        return None, why
    return set(pernode.needed((f.name for f in manifest.files), rank_files.rank_of, node_ranks, world)), ""


def _propose(storage: Storage, tried: set[str], skipped: list[str]) -> CheckpointInfo | None:
    """Rank 0: the newest complete checkpoint not tried yet. Incomplete ones (a save cut short) are
    named and passed over; corrupt ones are also counted in ``skipped``."""
    for info in reversed(scan(storage)):
        if info.name in tried:
            continue
        refuse_newer_format(storage, info)
        if info.complete:
            return info
        logger.warning("skipping %s: %s (%s)", storage.describe(info.name), info.status, info.problem)
        if info.status != "incomplete":
            skipped.append(f"{storage.describe(info.name)}: {info.status} ({info.problem})")
        tried.add(info.name)
    return None


def _fetch_into(
    storage: Storage, info: CheckpointInfo, dest: Path, names: set[str] | None, why: str, ranks: frozenset[int]
) -> None:
    """The verified files of ``info`` in ``names`` (None: all), in ``dest`` (emptied first); one INFO
    line says what the node of ``ranks`` fetched, what it left to other nodes, or ``why`` it took all."""
    shutil.rmtree(dest, ignore_errors=True)
    fetch_checkpoint(storage, info, dest, None if names is None else names.__contains__)
    files = info.manifest.files if info.manifest else ()
    have = list_folder(dest)
    left = [f.name for f in files if f.name not in have]
    logger.info(
        "the node of rank(s) %s fetched %d of %d files of %s (%d of %d bytes)%s%s",
        ",".join(map(str, sorted(ranks))),
        len(files) - len(left),
        len(files),
        info.name,
        sum(f.size for f in files if f.name in have),
        sum(f.size for f in files),
        f"; every file: {why}" if why else "",
        f"; left to other nodes' ranks: {_names(left)}" if left else "",
    )


def _names(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"
