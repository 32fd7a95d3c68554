"""The single-process engine: the whole state in one ``state.pt``, on one or two tiers.

Periodic saves are written to the first tier (``local``, e.g. the instance's NVMe, when given;
else the durable storage) and then uploaded to the durable storage, from a background thread.
Synchronous saves (emergency, final, manual) go straight to the durable storage. Resume takes the
newest checkpoint that verifies from either tier (the local copy first for the same step).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from spotguard.checkpoint import data, layout, reader, state
from spotguard.checkpoint.engine import Commit, OnCommit, Resumed, Tracked, Work, copy_extra
from spotguard.checkpoint.manifest import CheckpointInfo, FileEntry, Manifest, human_duration, step_dir
from spotguard.checkpoint.snapshot import Staging, canonical
from spotguard.errors import CheckpointCorruptError, CheckpointExistsError, CheckpointMismatchError
from spotguard.storage import Storage

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def refuse_sharded(info: CheckpointInfo) -> None:
    """Raise when a single process meets a checkpoint written by a process group (not skip it)."""
    m = info.manifest
    if m is not None and (m.world_size > 1 or any(f.name.startswith("shards/") for f in m.files)):
        raise CheckpointMismatchError(
            f"{info.name} is a sharded checkpoint of {m.world_size} rank(s): resume it in a process group "
            f"(torchrun --nproc-per-node {m.world_size}; another world size with Guard(..., reshard='reset-data'))"
        )


class SingleEngine:
    """Checkpoints of one process. ``staged_final``: the final save is staged like periodic ones,
    so that an unchanged state serialises to the same bytes (and is not written again)."""

    def __init__(
        self, storage: Storage, local: Storage | None, keep: int, on_commit: OnCommit, staged_final: bool = True
    ) -> None:
        self.storage, self.local, self.keep = storage, local, keep
        self.two_tiers = local is not None
        self._on_commit = on_commit
        self._staged_final = staged_final
        self._staging = Staging()
        self._lock = threading.Lock()  # the loop's thread and the background writer may both prune

    @property
    def staged_bytes(self) -> int:
        return self._staging.nbytes

    # -- saving --------------------------------------------------------------------------------
    def _payload(self, tracked: Tracked, step: int, staged: bool) -> dict[str, Any]:
        """The state as one canonical structure: the same state serialises to the same bytes (the final
        save compares them). A snapshot is canonical already (``Staging``): only the small parts are made so."""
        objects = state.collect(tracked.objects)
        rng = state.capture_rng()
        generators = {n: g for n, o in tracked.objects.items() if (g := data.generator_state(o)) is not None}
        if not staged:
            return canonical({"step": step, "rng": rng, "objects": objects, "generators": generators})
        return {
            "step": step,
            "rng": canonical(rng),
            "objects": self._staging.snapshot(objects),
            "generators": canonical(generators),
        }

    def stage(self, tracked: Tracked, step: int, reason: str) -> Work:
        with state.rng_isolated():  # collecting a loader's state may draw; leave no trace
            payload = self._payload(tracked, step, staged=True)
        extra = copy_extra(tracked.extra)  # the values of this step
        return lambda cancel: self._write_tiers(step, reason, payload, extra, cancel)

    def save(
        self, tracked: Tracked, step: int, reason: str, *, deadline: float | None = None, final: bool = False
    ) -> Manifest | None:
        t0 = time.monotonic()
        with state.rng_isolated():  # whatever the storage libraries draw, the RNG streams stay as they were
            payload = self._payload(tracked, step, staged=final and self._staged_final)
            manifest = self._write(self.storage, step, reason, payload, tracked.extra, deadline=deadline, replace=final)
        if manifest is not None:
            took = time.monotonic() - t0
            self._prune(self.storage)
            self._on_commit(Commit(manifest, "durable", took))
        return manifest

    def _write_tiers(
        self, step: int, reason: str, payload: dict[str, Any], extra: dict[str, Any], cancel: threading.Event
    ) -> None:
        """Background: serialise to the first tier, then upload to the durable storage."""
        first = self.local or self.storage
        t0 = time.monotonic()
        manifest = self._write(first, step, reason, payload, extra, cancel=cancel)
        if manifest is None:
            return
        took = time.monotonic() - t0
        self._prune(first)
        if self.local is not None:
            self._on_commit(Commit(manifest, "local", took))
            t1 = time.monotonic()
            info = CheckpointInfo(step, step_dir(step), "complete", manifest)
            try:
                layout.copy(self.local, self.storage, info, cancel=cancel)
            except CheckpointExistsError:
                pass
            took = time.monotonic() - t1
            self._prune(self.storage)
            self._on_commit(Commit(manifest, "durable", took, uploaded=True))
        else:
            self._on_commit(Commit(manifest, "durable", took))

    def _write(
        self,
        storage: Storage,
        step: int,
        reason: str,
        payload: dict[str, Any],
        extra: dict[str, Any],
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        replace: bool = False,
    ) -> Manifest | None:
        try:
            manifest = layout.write(
                storage,
                step,
                {STATE_FILE: lambda f: torch.save(payload, f)},
                reason=reason,
                extra=extra,
                world_size=_world_size(),
                torch_version=torch.__version__,
                deadline=deadline,
                cancel=cancel,
                replace=replace,
                on_content=self._drop_stale_local(step, extra) if replace else None,
            )
        except CheckpointExistsError:
            logger.info(
                "%s is already committed%s; not writing it twice",
                storage.describe(step_dir(step)),
                " with this state" if replace else "",
            )
            return None
        logger.info(
            "%s checkpoint of step %d written to %s (%.1f MB)", reason, step, storage.describe(), manifest.size / 1e6
        )
        return manifest

    def _prune(self, storage: Storage) -> None:
        with self._lock:
            try:
                layout.prune(storage, self.keep)
            except Exception as e:
                logger.warning("pruning old checkpoints in %s failed: %s", storage.describe(), e)

    def _drop_stale_local(self, step: int, extra: dict[str, Any]) -> Callable[[tuple[FileEntry, ...]], None]:
        """For a final save: delete the local tier's checkpoint of ``step`` when its content differs
        from the final one, before the durable tier is touched (resume prefers the local copy)."""

        def check(entries: tuple[FileEntry, ...]) -> None:
            if self.local is None:
                return
            for info in [i for i in reader.scan(self.local) if i.step == step]:
                m = info.manifest
                if m is None or m.files != entries or m.extra != json.loads(json.dumps(extra)):
                    layout.delete(self.local, info.name)
                    logger.info("removed %s: the final state of step %d differs", self.local.describe(info.name), step)

        return check

    # -- resuming ------------------------------------------------------------------------------
    def resume(self, tracked: Tracked) -> Resumed | None:
        tiers = [(s, reader.scan(s)) for s in ([self.local] if self.local else []) + [self.storage]]
        durable = [i.step for i in tiers[-1][1] if i.complete]
        candidates = sorted(((i, s) for s, infos in tiers for i in infos), key=lambda c: c[0].step, reverse=True)
        for info, storage in candidates:  # same step: the local tier comes first (stable sort)
            where = storage.describe(info.name)
            if not info.complete or info.manifest is None:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                continue
            t0 = time.monotonic()
            try:
                payload = self._load(storage, info)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                continue
            self._restore(tracked, info, payload)
            m = info.manifest
            logger.info(
                "resumed from step %d (%s, %s old) in %s", info.step, m.reason, human_duration(m.age_seconds()), where
            )
            _drop_killed_saves(tiers, info.step)
            return Resumed(info.step, m, where, time.monotonic() - t0, durable[-1] if durable else None)
        logger.info("no checkpoint in %s: starting from step 0", self.storage.describe())
        return None

    def _load(self, storage: Storage, info: CheckpointInfo) -> dict[str, Any]:
        refuse_sharded(info)
        with reader.open_verified(storage, info, STATE_FILE) as path:
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: cannot be loaded safely ({e})") from e
        if not isinstance(payload, dict) or payload.get("step") != info.step or "objects" not in payload:
            raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: unexpected content")
        return payload

    @staticmethod
    def _restore(tracked: Tracked, info: CheckpointInfo, payload: dict[str, Any]) -> None:
        state.restore(tracked.objects, payload["objects"], where=info.name)
        generators = payload.get("generators", {})
        for name, obj in tracked.objects.items():
            if data.is_stateful_loader(obj):
                data.restore_generator(obj, generators.get(name))
                data.neutralize_next_iterator(obj)
        state.restore_rng(payload["rng"])  # last: nothing after this may draw


def _drop_killed_saves(tiers: list[tuple[Storage, list[CheckpointInfo]]], resumed: int) -> None:
    """Delete incomplete ``step-N/`` older than the resume point: saves killed mid-write.

    Safe only here, before this run writes anything: the writer that left them is gone, and
    the run goes on past ``resumed``, so they would never be replaced. Corrupt ones are kept.
    """
    for storage, infos in tiers:
        for info in infos:
            if info.status == "incomplete" and info.step < resumed:
                try:
                    layout.delete(storage, info.name)
                    logger.info("removed %s: an unfinished save (%s)", storage.describe(info.name), info.problem)
                except OSError as e:  # StorageError included: cleanup must never fail a resume
                    logger.warning("cannot remove unfinished save %s: %s", storage.describe(info.name), e)
