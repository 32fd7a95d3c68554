"""The single-process engine: the whole state in one ``state.pt``, on one or two tiers.

Periodic saves are written to the first tier (``local``, e.g. the instance's NVMe, when given;
else the durable storage) and then uploaded to the durable storage, from a background thread.
Synchronous saves (emergency, final, manual) go straight to the durable storage. Resume takes the
newest checkpoint that verifies from either tier; for the same step, the copy committed last (the
local copy on a tie: an upload keeps the local manifest, so a tie is the same content).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spotguard.checkpoint.engine import Commit, OnCommit, Resumed, Tracked, Work, copy_extra
from spotguard.checkpoint.files import stream
from spotguard.checkpoint.files.fileio import WorkMeter
from spotguard.checkpoint.folders import layout, retention, stale_local
from spotguard.checkpoint.folders.fence import Fence
from spotguard.checkpoint.format import reader
from spotguard.checkpoint.format.manifest import CheckpointInfo, FileEntry, Manifest, human_duration, step_dir
from spotguard.checkpoint.format.verifying import Verifying
from spotguard.checkpoint.state import data, loadable, state, upload
from spotguard.checkpoint.state.budget import Budget, tensor_bytes
from spotguard.checkpoint.state.snapshot import HoldsStaging, Staging, canonical
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


class SingleEngine(HoldsStaging):
    """Checkpoints of one process. ``staged_final``: the final save is staged like periodic ones, so
    that an unchanged state serialises to the same bytes (and is not written again). A synchronous
    save of device state streams through a ring of pinned buffers (``stream``), as fast as a periodic
    write; ``staging_budget``: see ``budget.Budget``. An emergency save never prunes (the next does)."""

    def __init__(
        self,
        storage: Storage,
        local: Storage | None,
        keep: int,
        on_commit: OnCommit,
        staged_final: bool = True,
        rebatch: data.Rebatch | str = data.Rebatch.REFUSE,
        staging_budget: int | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.storage, self.local = storage, local
        self.fence = fence  # the writer lease's, called before each manifest on ``storage`` (not the local tier)
        self.budget = Budget(staging_budget)
        self._ring_made: stream.Ring | None = None
        self.rebatch = data.Rebatch(rebatch)
        self.two_tiers = local is not None
        self._on_commit = on_commit
        self._staged_final = staged_final
        self._staging = Staging()
        self._tidy = retention.Housekeeping(keep)
        self._checked = False  # the state was found loadable (``loadable.check``, at the first save)

    @property
    def _ring(self) -> stream.Ring:
        """The buffers device state streams through (made on first use, within the staging budget)."""
        if self._ring_made is None:
            self._ring_made = stream.Ring.within(self.budget.resolve())
        return self._ring_made

    def reserve(self, tracked: Tracked) -> None:
        """Start allocating the staging of periodic saves off the loop's thread (``Staging.reserve``)."""
        with state.rng_isolated():  # collecting a loader's state may draw
            objects = state.collect(tracked.objects)
        self._check_once(objects)  # at the first step: not at the first save, maybe hours later, nor on its stall
        if tensor_bytes(objects) <= self.budget.resolve():
            self._staging.reserve(objects)

    def _check_once(self, objects: dict[str, Any]) -> None:
        """A state a resume could not load fails here, once, before anything is written (``loadable``)."""
        if not self._checked:
            loadable.check(objects)
            self._checked = True

    def close(self) -> None:
        """Nothing waits here: the staging's allocation thread ends on its own."""

    # -- saving --------------------------------------------------------------------------------
    def _payload(self, tracked: Tracked, step: int, staged: bool, final: bool = False) -> tuple[dict[str, Any], bool]:
        """The state as one canonical structure: the same state serialises to the same bytes (the final
        save compares them). A snapshot is canonical already (``Staging``): only the small parts are made so.
        Returns it, and whether it is a snapshot (``staged`` and within the staging budget)."""
        cut = tracked.cut_at(step, final)
        rng = cut.rng if cut else state.capture_rng()  # first: collecting a loader's state may draw
        objects = state.collect(tracked.objects)
        if cut:
            data.as_at_last_batch(tracked.objects, objects)
        self._check_once(objects)
        generators = {n: g for n, o in tracked.objects.items() if (g := data.generator_state(o)) is not None}
        loaders = data.loader_facts(tracked.objects)  # what a resume compares (worker count, batch size)
        # Warm buffers within the budget: no walk (it costs as much as a small state's copy).
        warm = 0 < self._staging.nbytes <= self.budget.resolve()
        if not staged or not (warm or self.budget.fits(objects, self._ring.chunk * self._ring.slots)):
            payload = {"step": step, "rng": rng, "objects": objects, "generators": generators, "loaders": loaders}
            return canonical(payload), False
        return {
            "step": step,
            "rng": canonical(rng),
            "objects": self._staging.snapshot(objects),
            "generators": canonical(generators),
            "loaders": canonical(loaders),
        }, True

    def stage(self, tracked: Tracked, step: int, reason: str) -> Work:
        self._tidy.claim(step)  # this save replaces what a killed one of its step left
        with state.rng_isolated():  # collecting a loader's state may draw; leave no trace
            payload, snapshot = self._payload(tracked, step, staged=True)
            extra = copy_extra(tracked.extra)  # the values of this step
            if not snapshot:  # over the staging budget: the state itself, so written now, streamed
                return self._write_now(step, reason, payload, extra)
        return lambda cancel: self._write_tiers(step, reason, payload, extra, cancel)

    def _write_now(self, step: int, reason: str, payload: dict[str, Any], extra: dict[str, Any]) -> Work:
        """A periodic save over the staging budget: written to the first tier now, the rest in the background.
        A failure is the work's, as a background save's would be: never raised into the loop from here."""
        first, t0 = self.local or self.storage, time.monotonic()
        crcs: dict[str, Any] = {}
        try:
            manifest = self._write(first, step, reason, payload, extra, crcs=crcs)
        except Exception as e:
            error = e

            def fail(cancel: threading.Event) -> None:
                raise error

            return fail
        took = time.monotonic() - t0
        return lambda cancel: self._committed_first(step, manifest, took, crcs, cancel)

    def save(
        self, tracked: Tracked, step: int, reason: str, *, deadline: float | None = None, final: bool = False
    ) -> Manifest | None:
        t0 = time.monotonic()
        self._tidy.claim(step)
        stale: list[CheckpointInfo] = []
        with state.rng_isolated():  # whatever the storage libraries draw, the RNG streams stay as they were
            payload, _ = self._payload(tracked, step, staged=final and self._staged_final, final=final)
            on_content = stale_local.finder(self.local, step, tracked.extra, stale) if final else None
            manifest = self._write(
                self.storage, step, reason, payload, tracked.extra, deadline=deadline, on_content=on_content
            )
        stale_local.drop(self.local, stale)  # the durable tier holds the final content now (written or already there)
        if manifest is not None:
            took = time.monotonic() - t0
            if reason != "emergency":  # the deadline's clock runs: the next save prunes
                self._prune(self.storage, step)
            self._on_commit(Commit(manifest, "durable", took, synchronous=True))
        return manifest

    def _write_tiers(
        self, step: int, reason: str, payload: dict[str, Any], extra: dict[str, Any], cancel: threading.Event
    ) -> None:
        """Background: serialise to the first tier, then upload to the durable storage."""
        first = self.local or self.storage
        t0 = time.monotonic()
        crcs: dict[str, Any] = {}  # the durable storage's upload CRCs, kept while the local tier is written
        meter = None if first.streams else WorkMeter()
        manifest = self._write(first, step, reason, payload, extra, cancel=cancel, crcs=crcs, meter=meter)
        self._committed_first(step, manifest, time.monotonic() - t0, crcs, cancel, meter.seconds if meter else None)

    def _committed_first(
        self,
        step: int,
        manifest: Manifest | None,
        took: float,
        crcs: dict[str, Any],
        cancel: threading.Event,
        work_s: float | None = None,
    ) -> None:
        """A periodic save is on its first tier: prune it, and upload it to the durable storage (two tiers)."""
        if manifest is None:
            return
        first = self.local or self.storage
        self._prune(first, step)
        if self.local is not None:
            self._on_commit(Commit(manifest, "local", took, work_s=work_s))
            t1 = time.monotonic()
            info = CheckpointInfo(step, step_dir(step), "complete", manifest)
            try:
                layout.copy(self.local, self.storage, info, cancel=cancel, crcs=crcs, fence=self.fence, link=True)
            except CheckpointExistsError:
                pass
            took = time.monotonic() - t1
            self._prune(self.storage, step)
            self._on_commit(Commit(manifest, "durable", took, uploaded=True))
        else:
            self._on_commit(Commit(manifest, "durable", took, work_s=work_s))

    def _write(
        self,
        storage: Storage,
        step: int,
        reason: str,
        payload: dict[str, Any],
        extra: dict[str, Any],
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        on_content: Callable[[tuple[FileEntry, ...]], None] | None = None,
        crcs: dict[str, Any] | None = None,
        meter: WorkMeter | None = None,
    ) -> Manifest | None:
        """``on_content`` given: a final save, which replaces a committed ``step`` of other content.
        ``crcs`` given (a save to the local tier): filled with the durable storage's upload CRCs."""
        replace = on_content is not None or self._tidy.unloadable(storage, step)
        try:
            manifest = layout.write(
                storage,
                step,
                {STATE_FILE: lambda f: stream.save(payload, f, self._ring)},
                reason=reason,
                extra=extra,
                world_size=_world_size(),
                torch_version=torch.__version__,
                deadline=deadline,
                cancel=cancel,
                replace=replace,
                on_content=on_content,
                upload_crc=self.storage.upload_crc if crcs is not None and storage is not self.storage else None,
                crcs=crcs,
                meter=meter,
                fence=self.fence if storage is self.storage else None,
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

    def _prune(self, storage: Storage, step: int) -> None:
        """After a commit of ``step`` to ``storage``: old checkpoints beyond ``keep``, and saves killed above
        the resume point that this run has now passed (their step re-saved, or skipped)."""
        try:
            self._tidy.after_commit(storage, step)
        except Exception as e:
            logger.warning("pruning old checkpoints in %s failed: %s", storage.describe(), e)

    # -- resuming ------------------------------------------------------------------------------
    def resume(self, tracked: Tracked) -> Resumed | None:
        tiers = [(s, reader.scan(s)) for s in ([self.local] if self.local else []) + [self.storage]]
        durable = [i.step for i in tiers[-1][1] if i.complete]
        # Newest step first; for the same step its highest revision (machines' clocks may disagree), then
        # the copy committed last (a final save replaced the durable one and was killed before it dropped
        # the stale local one), the local one on a tie (stable sort).
        candidates = sorted(
            ((i, s) for s, infos in tiers for i in infos),
            key=lambda c: (c[0].step, c[0].revision, _committed_at(c[0])),
            reverse=True,
        )
        skipped: list[str] = []  # committed checkpoints that did not load, and why
        for info, storage in candidates:
            where = storage.describe(info.name)
            reader.refuse_newer_format(storage, info)  # not skipped: an older one would lose its work
            if not info.complete or info.manifest is None:
                logger.warning("skipping %s: %s (%s)", where, info.status, info.problem)
                if info.status != "incomplete":  # a save killed before its commit was never a checkpoint
                    skipped.append(f"{where}: {info.problem or info.status}")
                continue
            t0 = time.monotonic()
            try:
                payload = self._load(storage, info, tracked)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", where, e)
                skipped.append(f"{where}: {e}")
                reader.mark_corrupt(storage, info, e)
                continue
            self._restore(tracked, info, payload)
            m = info.manifest
            logger.info(
                "resumed from step %d (%s, %s old) in %s", info.step, m.reason, human_duration(m.age_seconds()), where
            )
            self._tidy.at_resume(tiers, info.step)
            durable = [s for s in durable if s <= info.step]  # a newer one that did not load is no resume point
            return Resumed(info.step, m, where, time.monotonic() - t0, durable[-1] if durable else None)
        if skipped:  # none loads: a fresh start (on_unloadable="fresh") must not count them, nor be pruned by them
            self._tidy.at_resume(tiers, 0)
            raise reader.none_loads(self.storage, skipped)
        logger.info("no checkpoint in %s: starting from step 0", self.storage.describe())
        return None

    def _load(self, storage: Storage, info: CheckpointInfo, tracked: Tracked) -> dict[str, Any]:
        """The payload of ``info``, read while its checksum is checked; returned once it matched."""
        refuse_sharded(info)
        with reader.open_verifying(storage, info, STATE_FILE) as (path, check):
            try:
                payload = self._read(path, info, tracked, check)
            except Exception:
                check.result()  # a file unlike its manifest is reported as that, whatever reading it raised
                raise
            check.result()
        return payload

    def _read(self, path: Path, info: CheckpointInfo, tracked: Tracked, check: Verifying) -> dict[str, Any]:
        try:  # the pickle and the zip's index: a few pages, read before the walk queues the disk up
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: cannot be loaded safely ({e})") from e
        check.start()
        if not isinstance(payload, dict) or payload.get("step") != info.step or "objects" not in payload:
            raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: unexpected content")
        state.refuse_untracked(payload["objects"], tracked.objects, info.name, tracked.untracked, state.TRACK_FIX)
        data.check_loaders(tracked.objects, payload["objects"], payload.get("loaders", {}), info.name, self.rebatch)
        if isinstance(payload["objects"], dict):  # accepted: GPU-bound tensors through pinned memory, behind the check
            upload.to_devices(tracked.objects, payload["objects"], path, check.wait_read)
        return payload

    def _restore(self, tracked: Tracked, info: CheckpointInfo, payload: dict[str, Any]) -> None:
        state.restore(tracked.objects, state.unmapped(tracked.objects, payload["objects"]), where=info.name)
        for name, obj in tracked.objects.items():
            if data.is_stateful_loader(obj):
                data.restore_generator(obj, payload.get("generators", {}).get(name))
                data.neutralize_next_iterator(obj)
        state.restore_rng(payload["rng"])  # last: nothing after this may draw


def _committed_at(info: CheckpointInfo) -> float:
    """When ``info`` was committed (its manifest's time), for ordering copies of one step; 0 when unknown."""
    try:
        return dt.datetime.fromisoformat(info.manifest.time).timestamp() if info.manifest else 0.0
    except ValueError:
        return 0.0
