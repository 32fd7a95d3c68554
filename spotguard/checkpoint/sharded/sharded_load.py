"""Resuming a sharded checkpoint in a process group: rank 0's listing is everyone's, failures are agreed on.

Each rank verifies what it reads before anything is loaded; ``collective.agree`` then raises on
every rank alike, so an older checkpoint is tried by all ranks together. A checkpoint saved by
another number of ranks is refused, or (``Reshard.RESET_DATA``) its model/optimizer state is
resharded by DCP and the per-rank state starts afresh.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from spotguard.checkpoint.collective import Groups, agree, broadcast, dcp_state, set_dcp_state, split
from spotguard.checkpoint.engine import Resumed, Tracked
from spotguard.checkpoint.folders.retention import Housekeeping
from spotguard.checkpoint.format.manifest import CheckpointInfo, Reshard, human_duration
from spotguard.checkpoint.format.reader import mark_corrupt, none_loads, open_verified, refuse_newer_format, scan
from spotguard.checkpoint.sharded.dcp import METADATA_FILE, SpotguardReader
from spotguard.checkpoint.state import data, state
from spotguard.errors import CheckpointCorruptError, CheckpointMismatchError, StorageError
from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _refusal(info: CheckpointInfo, world: int, per_rank: list[str]) -> str:
    saved = info.manifest.world_size if info.manifest else "?"
    return (
        f"{info.name} was saved by {saved} ranks and this job has {world}. Model and optimizer state "
        f"can be resharded, but per-rank state cannot: RNG streams and {', '.join(per_rank) or 'no other'}"
        f" object(s). Resume with {saved} ranks, or pass Guard(..., reshard='reset-data') to reshard "
        "model/optimizer, take the other tracked objects from rank 0 and restart data loaders and RNG streams."
    )


@contextlib.contextmanager
def _open_sized(storage: Storage, info: CheckpointInfo, fname: str) -> Iterator[Path]:
    """A local file of a checkpoint whose checksum another rank verified: its size is checked again."""
    entry = next(f for f in info.manifest.files if f.name == fname)  # type: ignore[union-attr]
    with storage.local_copy(f"{info.name}/{fname}") as path:
        if path.stat().st_size != entry.size:
            raise CheckpointCorruptError(f"{info.name}/{fname}: size {path.stat().st_size} != {entry.size} in manifest")
        yield path


def _load(storage: Storage, agreement: Groups, tracked: Tracked, info: CheckpointInfo, rebatch: data.Rebatch) -> None:
    """Load one checkpoint on every rank; raises on every rank alike (see ``collective.agree``).

    This rank's reads come first and are agreed on before ``dcp.load``, the restore after it: a
    rank whose storage failed must not leave the others waiting in a collective it never joins.
    """
    rank, world = agreement.rank, agreement.world_size
    assert info.manifest is not None
    resharding = info.manifest.world_size != world
    source = 0 if resharding else rank
    _, _, rest = split(tracked.objects)
    # On local (shared) storage every rank reads the very same files: each shard file is verified
    # once, by one rank, before the agreement below, not by every rank that reads from it (under
    # DDP, all of them). Downloaded copies (S3, GCS) are each rank's own: each is verified.
    shards = sorted(f.name for f in info.manifest.files if f.name.endswith(".distcp"))
    mine = shards[rank::world] if storage.scheme == "file" else []

    def opener(fname: str) -> Any:
        if fname in shards and storage.scheme == "file":
            return _open_sized(storage, info, fname)  # verified by its rank before the agreement
        return open_verified(storage, info, fname)

    error: BaseException | None = None
    with SpotguardReader(opener) as reader:
        try:
            for fname in mine:
                with open_verified(storage, info, fname):
                    pass
            # Fetched here, where an error keeps its type (DCP turns it into an AssertionError);
            # dcp.load then reads the verified local copy.
            metadata = reader.read_metadata()
            with opener(rank_file(source)) as path:
                try:
                    payload = torch.load(path, map_location="cpu", weights_only=True)
                except Exception as e:  # weights_only refuses anything but tensors and plain containers
                    raise CheckpointCorruptError(
                        f"{info.name}/{rank_file(source)}: cannot be loaded safely ({e})"
                    ) from e
            if not isinstance(payload, dict) or payload.get("step") != info.step or payload.get("rank") != source:
                raise CheckpointCorruptError(f"{info.name}/{rank_file(source)}: unexpected content")
            saved = set(payload["objects"]) | {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
            state.refuse_untracked(saved, tracked.objects, info.name, tracked.untracked, state.TRACK_FIX)
            if not resharding:  # resharded loaders start afresh: nothing of theirs is restored
                data.check_loaders(rest, payload["objects"], payload.get("loaders", {}), info.name, rebatch)
            sd = dcp_state(tracked.objects)
        except Exception as e:
            error = e
        agree(agreement, info.name, error)

        try:
            dcp.load(sd, storage_reader=reader, process_group=agreement.save_group)
            set_dcp_state(tracked.objects, sd)
            if resharding:
                keep = {n: o for n, o in rest.items() if not data.is_stateful_loader(o)}
                state.restore(keep, payload["objects"], where=info.name)
                logger.warning(
                    "%s: resharded from %d to %d ranks; data loaders (%s) and RNG streams start afresh",
                    info.name,
                    info.manifest.world_size,
                    world,
                    ", ".join(n for n in rest if n not in keep) or "none",
                )
            else:
                state.restore(rest, payload["objects"], where=info.name)
                generators = payload.get("generators", {})
                for name, obj in rest.items():
                    if data.is_stateful_loader(obj):
                        data.restore_generator(obj, generators.get(name))
                        data.neutralize_next_iterator(obj)
                state.restore_rng(payload["rng"])  # last: nothing after this may draw
        except (Exception, CheckpointException) as e:
            error = e
        agree(agreement, info.name, error)


def resume(
    storage: Storage,
    agreement: Groups,
    tracked: Tracked,
    reshard: Reshard,
    rebatch: data.Rebatch = data.Rebatch.REFUSE,
    tidy: Housekeeping | None = None,
) -> Resumed | None:
    """Collective ``Guard.resume``: rank 0's view of storage is everyone's; failures are agreed on. Rank 0
    hands the saves killed mid-write that it listed to ``tidy`` (gone below the resume point, and later
    above it)."""
    world = agreement.world_size
    listing: list[CheckpointInfo] | str = ""
    if agreement.rank == 0:
        try:
            listing = scan(storage)
        except Exception as e:
            listing = f"rank 0 cannot list {storage.describe()}: {type(e).__name__}: {e}"
    infos = broadcast(listing, agreement.save_group)
    if isinstance(infos, str):
        raise StorageError(infos)
    skipped: list[str] = []  # committed checkpoints that did not load, and why: the same on every rank
    for info in reversed(infos):
        refuse_newer_format(storage, info)  # on every rank alike (rank 0's listing): never skipped
        if not info.complete or info.manifest is None:
            if agreement.rank == 0:
                logger.warning("skipping %s: %s (%s)", storage.describe(info.name), info.status, info.problem)
            if info.status != "incomplete":  # a save killed before its commit was never a checkpoint
                skipped.append(f"{storage.describe(info.name)}: {info.problem or info.status}")
            continue
        names = {f.name for f in info.manifest.files}
        if f"shards/{METADATA_FILE}" not in names:
            raise CheckpointMismatchError(
                f"{info.name} is not a sharded checkpoint (written by a single process); "
                "resume it without a process group"
            )
        if info.manifest.world_size != world and reshard is Reshard.REFUSE:
            _, _, rest = split(tracked.objects)
            raise CheckpointMismatchError(_refusal(info, world, sorted(rest)))
        try:
            t0 = time.monotonic()
            _load(storage, agreement, tracked, info, rebatch)
        except CheckpointCorruptError as e:
            logger.warning("skipping %s: %s", storage.describe(info.name), e)
            skipped.append(f"{storage.describe(info.name)}: {e}")
            if agreement.rank == 0:
                mark_corrupt(storage, info, e)
            continue
        if tidy is not None:
            tidy.supersede(infos, info.step)  # every rank: the ones above that did not load
        if agreement.rank == 0:
            if tidy is not None:
                tidy.at_resume([(storage, infos)], info.step)
            logger.info(
                "resumed from step %d (%s, %s old, %d ranks) in %s",
                info.step,
                info.manifest.reason,
                human_duration(info.manifest.age_seconds()),
                info.manifest.world_size,
                storage.describe(info.name),
            )
        return Resumed(info.step, info.manifest, storage.describe(info.name), time.monotonic() - t0, info.step)
    if skipped:  # none loads: a fresh start (on_unloadable="fresh") must not count them, nor be pruned by them
        if tidy is not None:
            tidy.supersede(infos, 0)  # every rank: a save of their step supersedes them
            if agreement.rank == 0:
                tidy.at_resume([(storage, infos)], 0)
        raise none_loads(storage, skipped)
    if agreement.rank == 0:
        logger.info("no checkpoint in %s: starting from step 0", storage.describe())
    return None
