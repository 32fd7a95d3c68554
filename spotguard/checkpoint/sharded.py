"""Sharded checkpoints in a process group: DCP for model/optimizer, one small file per rank.

``<root>/step-00000100/`` holds ``shards/rank-NNNNN.distcp`` + ``shards/metadata.dcp`` (DCP,
written by every rank without gathering onto one), ``rank-NNNNN.pt`` (what belongs to one rank:
RNG streams, data loader position, other tracked objects) and ``manifest.json``. Order of a save,
every step collective on one gloo group (the guard's save group for synchronous saves, its async
group for periodic saves written in the background):

0. every rank collects its state (``collect``; for an async save, into reused host buffers: the
   only part that blocks the training loop);
1. rank 0 checks the step is not committed and clears leftovers of an interrupted save;
2. every rank writes its ``rank-NNNNN.pt``; then, unless that failed or was cancelled on any rank,
   ``dcp.save`` the shards;
3. every rank reports (error, its file entries with checksums, cancelled) to every rank;
4. rank 0 writes the manifest, write-once, only if every rank succeeded, and tells all the outcome.

A rank that dies anywhere before 4 leaves a directory without a manifest: not a checkpoint.
Modules and optimizers go through ``torch.distributed.checkpoint.state_dict`` (DDP and FSDP2 alike)
and reshard to another world size; per-rank state does not (see ``Reshard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from spotguard import checkpoint, errors
from spotguard.checkpoint import data, state
from spotguard.checkpoint.dcp import METADATA_FILE, SpotguardReader, SpotguardWriter
from spotguard.checkpoint.manifest import (
    MANIFEST,
    CheckpointInfo,
    FileEntry,
    HashingWriter,
    Manifest,
    Reshard,
)
from spotguard.checkpoint.snapshot import Staging
from spotguard.errors import CheckpointCorruptError, CheckpointMismatchError, SaveCancelled, StorageError

if TYPE_CHECKING:
    from spotguard.guard.agreement import Agreement
    from spotguard.guard.guard import Guard
    from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)


def refuse_sharded(info: CheckpointInfo) -> None:
    """Raise when a single process meets a checkpoint written by a process group (not skip it)."""
    m = info.manifest
    if m is not None and (m.world_size > 1 or any(f.name.startswith("shards/") for f in m.files)):
        raise CheckpointMismatchError(
            f"{info.name} is a sharded checkpoint of {m.world_size} rank(s): resume it in a process group "
            f"(torchrun --nproc-per-node {m.world_size}; another world size with Guard(..., reshard='reset-data'))")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _owner(opt: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    """The tracked module whose parameters this optimizer updates."""
    first = next(p for g in opt.param_groups for p in g["params"])
    for module in modules.values():
        if any(p is first for p in module.parameters()):
            return module
    raise CheckpointMismatchError("a tracked optimizer updates parameters of no tracked module: track the model too")


def _split(objects: dict[str, Any]) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer], dict[str, Any]]:
    modules = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    optims = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    rest = {n: o for n, o in objects.items() if n not in modules and n not in optims}
    return modules, optims, rest


def _dcp_state(objects: dict[str, Any]) -> dict[str, Any]:
    modules, optims, _ = _split(objects)
    sd: dict[str, Any] = {n: get_model_state_dict(m) for n, m in modules.items()}
    sd.update({n: get_optimizer_state_dict(_owner(o, modules), o) for n, o in optims.items()})
    return sd


def _set_dcp_state(objects: dict[str, Any], sd: dict[str, Any]) -> None:
    modules, optims, _ = _split(objects)
    for n, m in modules.items():
        set_model_state_dict(m, sd[n])
    for n, o in optims.items():
        set_optimizer_state_dict(_owner(o, modules), o, sd[n])


def _broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _failures(error: BaseException, rank: int) -> list[tuple[int, BaseException]]:
    """(rank, exception) behind one error: DCP hands every rank the exceptions of all failed ranks."""
    if isinstance(error, CheckpointException):
        return sorted(((r, exc) for r, (exc, _) in error.failures.items()), key=lambda f: f[0])
    return [(rank, error)]


def _explain(error: BaseException, rank: int) -> str:
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in _failures(error, rank))


def _kind(error: BaseException) -> str:
    """The name of the spotguard error class that ``error`` is (or its nearest base), else SpotguardError."""
    return next((c.__name__ for c in type(error).__mro__ if c.__module__ == errors.__name__), "SpotguardError")


def _agree(agreement: Agreement, where: str, error: BaseException | None) -> None:
    """Collective: raise on every rank when any rank failed, naming each rank's error.

    Corruption everywhere it failed is a ``CheckpointCorruptError`` (the caller tries an older
    checkpoint, as a single process does); anything else (a storage error, state that does not fit)
    is raised as the spotguard error class of the lowest failing rank.
    """
    local = [(r, _kind(e), f"{type(e).__name__}: {e}") for r, e in _failures(error, agreement.rank)] if error else []
    corrupt = errors.CheckpointCorruptError.__name__
    # MAX of every rank's code: a failure on one rank reaches all before the next collective.
    if not agreement.reduce(max((1 if k == corrupt else 2 for _, k, _ in local), default=0), agreement.save_group):
        return
    reports: list[Any] = [None] * agreement.world_size
    dist.all_gather_object(reports, local, group=agreement.save_group)
    failures = sorted({f for per_rank in reports for f in per_rank})  # DCP reports the same on every rank
    kind = next((k for _, k, _ in failures if k != corrupt), corrupt)
    text = "; ".join(f"rank {r}: {msg}" for r, _, msg in failures)
    raise getattr(errors, kind)(f"{where} cannot be loaded: {text}") from error


@dataclasses.dataclass
class Staged:
    """What one rank saves: its own file's payload, its DCP state dict, or why it could not collect them."""

    payload: dict[str, Any]
    sd: dict[str, Any]
    error: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # guard.extra when collected


def collect(guard: Guard, rank: int, world: int, step: int, staging: Staging | None = None) -> Staged:
    """This rank's state, never raising (a failure is carried, then agreed on by ``write``).

    With ``staging`` (async saves) every tensor is copied into its reused host buffers, so that
    training may go on while the copy is written; without, the live tensors are written at once.
    """
    _, _, rest = _split(guard._objects)
    with state.rng_isolated():
        try:
            payload = {"step": step, "rank": rank, "world_size": world,
                       "rng": state.capture_rng(),  # first: collecting a loader's state may draw
                       "objects": state.collect(rest),
                       "generators": {n: g for n, o in rest.items() if (g := data.generator_state(o)) is not None}}
            sd = _dcp_state(guard._objects)
            if staging is not None:
                staged = staging.snapshot({"objects": payload["objects"], "sd": sd})
                payload["objects"], sd = staged["objects"], staged["sd"]
            from spotguard.guard.guard import _copy_extra
            return Staged(payload, sd, extra=_copy_extra(guard.extra))  # this step's, whatever the loop sets later
        except Exception as e:
            return Staged({}, {}, _explain(e, rank))


def write(guard: Guard, agreement: Agreement, group: Any, step: int, reason: str, staged: Staged,
          deadline: float | None, cancel: threading.Event | None = None) -> Manifest | None:
    """Collective on ``group``: every rank calls it for the same step, in the same order of collectives
    whatever happens (failures and ``cancel`` are agreed on, never acted on by one rank alone).

    Returns the manifest, or None when the step is already committed. Raises ``StorageError`` (any
    rank failed) or ``SaveCancelled`` (any rank was cancelled) on all ranks alike.
    """
    storage, rank, world = guard.storage, agreement.rank, agreement.world_size
    name = checkpoint.step_dir(step)
    status = "ok"
    if rank == 0:
        try:
            existing = storage.list(name + "/")
            if f"{name}/{MANIFEST}" in existing:
                status = "exists"
            elif existing:
                logger.info("replacing %d leftover file(s) of an interrupted save in %s", len(existing),
                            storage.describe(name))
                storage.delete(existing)
        except Exception as e:
            status = f"rank 0 cannot prepare {storage.describe(name)}: {e}"
    status = _broadcast(status, group)
    if status == "exists":
        logger.info("%s is already committed; not writing it twice", storage.describe(name))
        return None
    if status != "ok":
        raise StorageError(status)

    def cancelled() -> bool:
        return cancel is not None and cancel.is_set()

    error, entries = staged.error, []
    if not error:
        try:  # fails on this rank alone: caught, then agreed on below
            with storage.open_write(f"{name}/{rank_file(rank)}", deadline=deadline) as raw:
                out = HashingWriter(raw)
                torch.save(staged.payload, out)  # type: ignore[arg-type]
            entries.append(FileEntry(rank_file(rank), out.size, out.hexdigest(), out.chunk_size))
        except Exception as e:
            error = _explain(e, rank)
    # dcp.save is collective: every rank enters it, or (after a failure or cancel on any rank) none does
    if not agreement.reduce(2 if error else int(cancelled()), group):
        writer = SpotguardWriter(storage, name, rank, deadline=deadline)
        try:
            dcp.save(staged.sd, storage_writer=writer, process_group=group)
            entries.extend(writer.entries)
        except (Exception, CheckpointException) as e:  # DCP raises a failure on any rank on all ranks
            error = _explain(e, rank)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, (error, [dataclasses.astuple(e) for e in entries], cancelled()), group=group)

    outcome: str | bytes | None = ""
    if rank == 0:
        failed = dict.fromkeys(err for err, _, _ in reports if err)  # DCP reports the same on every rank
        if failed:
            outcome = "; ".join(failed)
        elif cancelled() or any(c for _, _, c in reports):
            outcome = None  # abandoned (an emergency save took over): never committed
        else:
            files = sorted((FileEntry(*e) for _, es, _ in reports for e in es), key=lambda f: f.name)
            manifest = Manifest(step=step, reason=reason, files=tuple(files), world_size=world,
                                extra=staged.extra, torch_version=torch.__version__)
            try:
                storage.put_bytes(f"{name}/{MANIFEST}", manifest.to_bytes(), exclusive=True, deadline=deadline)
                outcome = manifest.to_bytes()
            except Exception as e:
                outcome = f"rank 0: manifest not written: {type(e).__name__}: {e}"
    outcome = _broadcast(outcome, group)
    if outcome is None:
        raise SaveCancelled(f"sharded save of {name} abandoned before its commit")
    if isinstance(outcome, str):
        raise StorageError(f"sharded checkpoint of step {step} not committed: {outcome}")
    manifest = Manifest.from_bytes(outcome, where=name)
    logger.info("%s checkpoint of step %d written by %d ranks (%.1f MB)", reason, step, world, manifest.size / 1e6)
    if rank == 0:
        try:
            checkpoint.prune(storage, guard.options.keep)
        except Exception as e:
            logger.warning("pruning old checkpoints failed: %s", e)
    return manifest


def save(guard: Guard, agreement: Agreement, step: int, reason: str, deadline: float | None) -> Manifest | None:
    """Collective, synchronous: every rank calls it for the same step. Raises ``StorageError`` on all ranks alike."""
    staged = collect(guard, agreement.rank, agreement.world_size, step)
    manifest = write(guard, agreement, agreement.save_group, step, reason, staged, deadline)
    guard._saved_step = step
    if manifest is not None:
        guard.last_saved = manifest
    guard._schedule(step)
    return manifest


def save_staged(guard: Guard, agreement: Agreement, step: int, reason: str, staged: Staged,
                cancel: threading.Event) -> None:
    """Background (``PendingSave``): write a staged save on the agreement's async group, then record it."""
    t0 = time.monotonic()
    manifest = write(guard, agreement, agreement.async_group, step, reason, staged, None, cancel)
    if manifest is None:
        return
    took = time.monotonic() - t0
    guard.last_saved = manifest
    guard._stats.record_write(took, manifest.size)
    guard._durable_step = max(step, guard._durable_step or 0)
    guard._stats.checkpoints += 1
    guard._committed(manifest, "durable", took, durable=True)


def _refusal(info: CheckpointInfo, world: int, per_rank: list[str]) -> str:
    saved = info.manifest.world_size if info.manifest else "?"
    return (f"{info.name} was saved by {saved} ranks and this job has {world}. Model and optimizer state "
            f"can be resharded, but per-rank state cannot: RNG streams and {', '.join(per_rank) or 'no other'}"
            f" object(s). Resume with {saved} ranks, or pass Guard(..., reshard='reset-data') to reshard "
            "model/optimizer, take the other tracked objects from rank 0 and restart data loaders and RNG streams.")


@contextlib.contextmanager
def _open_sized(storage: Storage, info: CheckpointInfo, fname: str) -> Iterator[Path]:
    """A local file of a checkpoint whose checksum another rank verified: its size is checked again."""
    entry = next(f for f in info.manifest.files if f.name == fname)  # type: ignore[union-attr]
    with storage.local_copy(f"{info.name}/{fname}") as path:
        if path.stat().st_size != entry.size:
            raise CheckpointCorruptError(f"{info.name}/{fname}: size {path.stat().st_size} != {entry.size} in manifest")
        yield path


def _load(guard: Guard, agreement: Agreement, info: CheckpointInfo) -> None:
    """Load one checkpoint on every rank; raises on every rank alike (see ``_agree``).

    This rank's reads come first and are agreed on before ``dcp.load``, the restore after it: a
    rank whose storage failed must not leave the others waiting in a collective it never joins.
    """
    storage, rank, world = guard.storage, agreement.rank, agreement.world_size
    assert info.manifest is not None
    resharding = info.manifest.world_size != world
    source = 0 if resharding else rank
    _, _, rest = _split(guard._objects)
    # On local (shared) storage every rank reads the very same files: each shard file is verified
    # once, by one rank, before the agreement below, not by every rank that reads from it (under
    # DDP, all of them). Downloaded copies (S3, GCS) are each rank's own: each is verified.
    shards = sorted(f.name for f in info.manifest.files if f.name.endswith(".distcp"))
    mine = shards[rank::world] if storage.scheme == "file" else []

    def opener(fname: str) -> Any:
        if fname in shards and storage.scheme == "file":
            return _open_sized(storage, info, fname)  # verified by its rank before the agreement
        return checkpoint.open_verified(storage, info, fname)

    error: BaseException | None = None
    with SpotguardReader(opener) as reader:
        try:
            for fname in mine:
                with checkpoint.open_verified(storage, info, fname):
                    pass
            # Fetched here, where an error keeps its type (DCP turns it into an AssertionError);
            # dcp.load then reads the verified local copy.
            reader.read_metadata()
            with opener(rank_file(source)) as path:
                try:
                    payload = torch.load(path, map_location="cpu", weights_only=True)
                except Exception as e:  # weights_only refuses anything but tensors and plain containers
                    raise CheckpointCorruptError(f"{info.name}/{rank_file(source)}: cannot be loaded safely ({e})") from e
            if not isinstance(payload, dict) or payload.get("step") != info.step or payload.get("rank") != source:
                raise CheckpointCorruptError(f"{info.name}/{rank_file(source)}: unexpected content")
            sd = _dcp_state(guard._objects)
        except Exception as e:
            error = e
        _agree(agreement, info.name, error)

        try:
            dcp.load(sd, storage_reader=reader, process_group=agreement.save_group)
            _set_dcp_state(guard._objects, sd)
            if resharding:
                keep = {n: o for n, o in rest.items() if not data.is_stateful_loader(o)}
                state.restore(keep, payload["objects"], where=info.name)
                logger.warning("%s: resharded from %d to %d ranks; data loaders (%s) and RNG streams start afresh",
                               info.name, info.manifest.world_size, world,
                               ", ".join(n for n in rest if n not in keep) or "none")
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
        _agree(agreement, info.name, error)


def resume(guard: Guard, agreement: Agreement) -> int:
    """Collective ``Guard.resume``: rank 0's view of storage is everyone's; failures are agreed on."""
    storage, world = guard.storage, agreement.world_size
    listing: list[CheckpointInfo] | str = ""
    if agreement.rank == 0:
        try:
            listing = checkpoint.scan(storage)
        except Exception as e:
            listing = f"rank 0 cannot list {storage.describe()}: {type(e).__name__}: {e}"
    infos = _broadcast(listing, agreement.save_group)
    if isinstance(infos, str):
        raise StorageError(infos)
    for info in reversed(infos):
        if not info.complete or info.manifest is None:
            if agreement.rank == 0:
                logger.warning("skipping %s: %s (%s)", storage.describe(info.name), info.status, info.problem)
            continue
        names = {f.name for f in info.manifest.files}
        if f"shards/{METADATA_FILE}" not in names:
            raise CheckpointMismatchError(f"{info.name} is not a sharded checkpoint (written by a single process); "
                                          "resume it without a process group")
        if info.manifest.world_size != world and Reshard(guard.options.reshard) is Reshard.REFUSE:
            _, _, rest = _split(guard._objects)
            raise CheckpointMismatchError(_refusal(info, world, sorted(rest)))
        try:
            _load(guard, agreement, info)
        except CheckpointCorruptError as e:
            logger.warning("skipping %s: %s", storage.describe(info.name), e)
            continue
        guard.extra.clear()
        guard.extra.update(info.manifest.extra)
        guard._step = guard._saved_step = info.step
        guard.last_saved = info.manifest
        guard._schedule(info.step)
        if agreement.rank == 0:
            logger.info("resumed from step %d (%s, %s old, %d ranks) in %s", info.step, info.manifest.reason,
                        checkpoint.human_duration(info.manifest.age_seconds()), info.manifest.world_size,
                        storage.describe(info.name))
        return info.step
    if agreement.rank == 0:
        logger.info("no checkpoint in %s: starting from step 0", storage.describe())
    return 0
