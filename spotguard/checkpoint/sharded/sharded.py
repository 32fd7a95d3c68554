"""Sharded checkpoints in a process group: DCP for model/optimizer, one small file per rank.

``<root>/step-00000100/`` holds ``shards/rank-NNNNN.distcp`` + ``shards/metadata.dcp`` (DCP,
written by every rank without gathering onto one), ``rank-NNNNN.pt`` (what belongs to one rank:
RNG streams, data loader position, other tracked objects) and ``manifest.json``. Order of a
synchronous save, every step collective on the guard's save group (a save written in the
background takes the same steps, coordinated through the job's store: ``sharded_async``):

0. every rank collects its state (``ShardedEngine.stage``/``save``; for an async save, the ranks agree on
   DCP's plan first and each copies the items it writes into reused host buffers, ``sharded_plan``: the
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

import dataclasses
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from spotguard.checkpoint.collective import Groups, agree, broadcast, explain
from spotguard.checkpoint.engine import Commit, OnCommit, Resumed, Tracked, Work
from spotguard.checkpoint.files import filewrite, stream
from spotguard.checkpoint.files.fileio import WorkMeter
from spotguard.checkpoint.folders import layout, retention
from spotguard.checkpoint.folders.fence import Fence, fenced
from spotguard.checkpoint.format.manifest import MANIFEST, FileEntry, Manifest, Reshard, step_dir
from spotguard.checkpoint.sharded import sharded_async, sharded_load, sharded_plan
from spotguard.checkpoint.sharded.dcp import SpotguardWriter
from spotguard.checkpoint.sharded.sharded_load import rank_file
from spotguard.checkpoint.sharded.staged import Staged, collected
from spotguard.checkpoint.state import data, loadable
from spotguard.checkpoint.state.budget import Budget
from spotguard.checkpoint.state.snapshot import HoldsStaging, Staging, canonical
from spotguard.errors import LeaseLostError, StorageError, UnloadableStateError
from spotguard.storage.base import Storage

logger = logging.getLogger(__name__)

RESERVE_WAIT_S = 60.0  # the longest the first step waits for the other ranks' plans (``reserve``)


class ShardedEngine(HoldsStaging):
    """Checkpoints of a process group, every call collective (see the module docstring).

    ``groups`` is the guard's ``Agreement``: synchronous saves and resume run on its save group;
    staged saves are written by the background writer's thread through its store.
    """

    two_tiers = False  # straight to the durable storage: every rank writes its part there

    def __init__(
        self,
        storage: Storage,
        groups: Groups,
        keep: int,
        on_commit: OnCommit,
        reshard: Reshard | str = Reshard.REFUSE,
        rebatch: data.Rebatch | str = data.Rebatch.REFUSE,
        fence: Fence | None = None,
        staging_budget: int | None = None,
    ) -> None:
        self.storage, self.groups = storage, groups
        self.budget = Budget(staging_budget)  # a rank's share of a background save (``stage``)
        self.fence = fence  # rank 0's writer lease's, called before each manifest (``_commit``)
        self.reshard = Reshard(reshard)
        self.rebatch = data.Rebatch(rebatch)
        self._checked = False  # every rank's state was found loadable (``_check_once``, at the first save)
        self._on_commit = on_commit
        self._tidy = retention.Housekeeping(keep)  # rank 0 prunes; every rank names directories (``dir_for``)
        self._staging = Staging()
        self._ring = stream.Ring()  # a synchronous save's device tensors reach the files through it
        self._staged = 0  # staged saves so far: the same count on every rank, it names their keys
        self._plan = sharded_plan.Cache()  # the DCP plan agreed last (``reserve``, ``stage``)
        self._reserving: threading.Thread | None = None  # ``reserve``'s plan and allocation, until ``stage``
        self._closed = threading.Event()  # ``close``: a reservation still waiting for its peers gives up

    def reserve(self, tracked: Tracked) -> None:
        """Start allocating the staging of background saves off the loop's thread, for the items this rank's
        plan writes. Every rank calls this at its first step: the state is collected here (the loop's
        thread: nothing else reads it); agreeing on the plan through the store as a staged save does
        (``sharded_plan``, waiting at most ``RESERVE_WAIT_S`` for the other ranks) and allocating
        (``Staging.reserve``) run on a thread of their own, which the first ``stage`` waits for. A plan
        not agreed reserves nothing: the first save allocates, as it would have."""
        g = self.groups
        if g.store is None or self._reserving is not None:  # synchronous saves stage nothing
            return
        live = collected(tracked, self.groups, 0, final=True)  # seq 0: no save's (``stage`` counts from 1)
        # The thread walks fresh containers: a tracked object's own dict may change while the loop trains.
        objects = canonical(live.payload.get("objects"))
        self._reserving = threading.Thread(
            target=self._reserve, args=(live, objects), name="spotguard-plan", daemon=True
        )
        self._reserving.start()

    def _reserve(self, live: Staged, objects: Any) -> None:
        g = self.groups
        ex = sharded_async.Exchange(
            g.store, f"{g.uid}/0/", g.rank, g.world_size, self._closed, min(g.timeout_s, RESERVE_WAIT_S)
        )
        writer = SpotguardWriter(self.storage, step_dir(0), g.rank)
        try:
            planned = sharded_plan.agree(ex, writer, None if live.error else live.sd, live.error, self._plan)
            ex.forget([f"plan/{r}" for r in range(1, g.world_size)] if g.rank == 0 else [f"gplan/{g.rank}"])  # read
        except Exception as e:  # never the loop's: the first save plans and allocates as it would have
            self._plan.clear()
            logger.warning("cannot reserve the checkpoint staging (%s: %s)", type(e).__name__, e)
            return
        share = {"objects": objects, "items": planned.items}
        if self._closed.is_set():
            return
        if planned.error:
            logger.warning("cannot reserve the checkpoint staging: %s; the first save allocates it", planned.error)
        elif self.budget.fits(share, self._ring.chunk * self._ring.slots):  # over: its saves stage nothing
            try:  # the plan stands (every rank agreed on it): only the staging is not reserved
                self._staging.reserve(share)
            except Exception as e:
                logger.warning("cannot reserve the checkpoint staging (%s: %s)", type(e).__name__, e)

    def close(self) -> None:
        """A reservation still waiting for its peers gives up (the guard is closing); wait for its thread."""
        self._closed.set()
        if self._reserving is not None:
            self._reserving.join(10.0)

    def _reserved(self) -> float:
        """Wait for ``reserve``'s thread (its plan is the cache ``stage`` starts from); the seconds waited."""
        if self._reserving is None:
            return 0.0
        t0 = time.perf_counter()
        self._reserving.join()
        self._reserving = None
        return time.perf_counter() - t0

    def _snapshot(self, staged: Staged, planned: sharded_plan.Planned) -> Staged:
        """Copy this rank's own file's objects and the DCP items its plan writes (only those: under DDP a
        replicated item is another rank's to write) into the reused host buffers; training may go on."""
        if staged.error or planned.error:
            return Staged({}, {}, staged.error or planned.error)
        try:
            copied = self._staging.snapshot({"objects": staged.payload["objects"], "items": planned.items})
        except Exception as e:
            return Staged({}, {}, explain(e, self.groups.rank))
        planned.items = copied["items"]
        return Staged({**staged.payload, "objects": copied["objects"]}, planned.items, extra=staged.extra)

    def save(
        self, tracked: Tracked, step: int, reason: str, *, deadline: float | None = None, final: bool = False
    ) -> Manifest | None:
        """Collective, synchronous. Raises ``StorageError`` on all ranks alike. A committed step is never
        replaced (a final save of it returns None); one that did not load is superseded (``dir_for``)."""
        t0 = time.monotonic()
        self._tidy.claim(step)  # this save replaces what a killed one of its step left
        staged = collected(tracked, self.groups, step, final=final)
        self._check_once(staged, step, collective=True)
        manifest = self._write(step, reason, staged, deadline)
        if manifest is not None:
            self._on_commit(Commit(manifest, "durable", time.monotonic() - t0, synchronous=True))
        return manifest

    def stage(self, tracked: Tracked, step: int, reason: str) -> Work:
        """Agree on the DCP plan through the store (``sharded_plan``), snapshot the items this rank writes
        into the reused buffers; the work writes them, coordinated through the store (``sharded_async``),
        never through a collective. A share over the staging budget (``budget.Budget``) is written before
        this returns, from the live state."""
        g = self.groups
        self._tidy.claim(step)
        waited = self._reserved()
        self._staged += 1
        ex = sharded_async.Exchange(
            g.store, f"{g.uid}/{self._staged}/", g.rank, g.world_size, threading.Event(), g.timeout_s
        )
        live = collected(tracked, self.groups, step)
        writer = SpotguardWriter(self.storage, self._tidy.dir_for(step), g.rank)
        planned = sharded_plan.agree(ex, writer, None if live.error else live.sd, live.error, self._plan, self._staged)
        self._check_once(live, step, collective=False)
        share = {"objects": live.payload.get("objects"), "items": planned.items}
        over = not (live.error or planned.error) and not self.budget.fits(share, self._ring.chunk * self._ring.slots)
        staged = live if over else self._snapshot(live, planned)
        self._staging.alloc_s += waited  # setting up, not the loop's steady cost (``alloc_s``)
        del live  # the live tensors: not kept by the work

        def work(cancel: threading.Event) -> None:
            t0 = time.monotonic()
            meter = WorkMeter()
            raw = sharded_async.write(
                dataclasses.replace(ex, cancel=cancel),
                self.storage,
                step,
                self._tidy.dir_for(step),
                (planned.plan, planned.planner(g.rank), planned.metadata),
                prepare=lambda: self._prepare(step),
                write_rank_file=lambda: self._write_rank_file(step, staged, None, meter),
                commit=lambda files: self._commit(step, reason, files, staged.extra, None),
                meter=meter,
                ring=self._ring if over else None,
            )
            if raw is not None:
                manifest = self._committed(raw[0], step, reason)
                self._on_commit(Commit(manifest, "durable", time.monotonic() - t0, work_s=raw[1]))

        # This rank's share over its staging budget: written now from the live state, streamed through the
        # ring, while the other ranks' background writes go on (the single engine does the same).
        return self._done_now(work) if over else work

    @staticmethod
    def _done_now(work: Work) -> Work:
        """Run ``work`` here; the work that remains raises its error, if any, where a background save's is
        raised (training goes on), else does nothing."""
        try:
            work(threading.Event())
        except Exception as e:
            error = e

            def failed(cancel: threading.Event) -> None:
                raise error

            return failed
        return lambda cancel: None

    def _check_once(self, staged: Staged, step: int, collective: bool) -> None:
        """At the first save only: raise ``UnloadableStateError`` when this rank's state holds a value a resume
        could not load (``loadable.check``), before anything is written.

        ``collective`` (a synchronous save, itself collective): every rank raises when any rank failed. A staged
        save raises on the ranks that failed only, which is every rank when they track the same kinds of
        objects; another rank's background write then ends at its timeout, with nothing committed.
        """
        if self._checked:
            return
        error: UnloadableStateError | None = None
        if not staged.error:  # a failed collection is reported by the save itself
            try:
                loadable.check(staged.payload["objects"])
                loadable.check(staged.sd, as_items=True)  # DCP writes every tensor as an item of its own
            except UnloadableStateError as e:
                error = e
        if collective:
            agree(self.groups, f"the checkpoint of step {step}", error, what="cannot be written")
        elif error is not None:
            raise error
        self._checked = True

    def resume(self, tracked: Tracked) -> Resumed | None:
        return sharded_load.resume(self.storage, self.groups, tracked, self.reshard, self.rebatch, self._tidy)

    def _prepare(self, step: int) -> str:
        """Rank 0, before any rank writes (``layout.prepare``)."""
        return layout.prepare(self.storage, self._tidy.dir_for(step), self.fence)

    def _write_rank_file(
        self, step: int, staged: Staged, deadline: float | None, meter: WorkMeter | None = None
    ) -> tuple[str, list[FileEntry]]:
        """This rank's ``rank-NNNNN.pt``: (error, [its entry]); a failure is returned, to be agreed on."""
        if staged.error:
            return staged.error, []
        rank = self.groups.rank
        key = f"{self._tidy.dir_for(step)}/{rank_file(rank)}"
        try:
            entry = filewrite.put(
                self.storage,
                key,
                rank_file(rank),
                lambda f: stream.save(staged.payload, f, self._ring),
                deadline=deadline,
                meter=meter,
            )
        except Exception as e:
            return explain(e, rank), []
        return "", [entry]

    def _commit(
        self, step: int, reason: str, files: list[FileEntry], extra: dict[str, Any], deadline: float | None
    ) -> bytes:
        """Rank 0, once every rank succeeded: write the manifest, write-once. Raises on failure."""
        manifest = Manifest(
            step=step,
            reason=reason,
            files=tuple(sorted(files, key=lambda f: f.name)),
            world_size=self.groups.world_size,
            extra=extra,
            torch_version=torch.__version__,
        )
        raw = manifest.to_bytes()
        deadline = fenced(self.fence, deadline)  # rank 0 holds the run's lease: a lost one commits nothing
        self.storage.put_bytes(f"{self._tidy.dir_for(step)}/{MANIFEST}", raw, exclusive=True, deadline=deadline)
        return raw

    def _committed(self, raw: bytes, step: int, reason: str) -> Manifest:
        """Every rank, after the commit: the manifest; rank 0 prunes old checkpoints, except after an
        emergency save (nothing but its commit on the deadline's clock: the next save prunes)."""
        manifest = Manifest.from_bytes(raw, where=self._tidy.dir_for(step))
        world = self.groups.world_size
        logger.info("%s checkpoint of step %d written by %d ranks (%.1f MB)", reason, step, world, manifest.size / 1e6)
        if self.groups.rank == 0 and reason != "emergency":
            try:
                self._tidy.after_commit(self.storage, step)
            except Exception as e:
                logger.warning("pruning old checkpoints failed: %s", e)
        return manifest

    def _write(self, step: int, reason: str, staged: Staged, deadline: float | None) -> Manifest | None:
        """Collective on the save group: every rank calls it for the same step, in the same order of
        collectives whatever happens (a failure is agreed on, never acted on by one rank alone).

        Returns the manifest, or None when the step is already committed. Raises ``StorageError``
        (any rank failed) on all ranks alike.
        """
        group, rank, world = self.groups.save_group, self.groups.rank, self.groups.world_size
        name = self._tidy.dir_for(step)  # its next revision after a fresh start beside an unloadable one
        status = broadcast(self._prepare(step) if rank == 0 else "", group)
        if status == "exists":
            logger.info("%s is already committed; not writing it twice", self.storage.describe(name))
            return None
        if status != "ok":
            raise StorageError(status)
        error, entries = self._write_rank_file(step, staged, deadline)
        # dcp.save is collective: every rank enters it, or (after a failure on any rank) none does
        if not self.groups.reduce(2 if error else 0, group):
            writer = SpotguardWriter(self.storage, name, rank, deadline=deadline, ring=self._ring)
            try:
                dcp.save(staged.sd, storage_writer=writer, process_group=group)
                entries.extend(writer.entries)
            except (Exception, CheckpointException) as e:  # DCP raises a failure on any rank on all ranks
                error = explain(e, rank)
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, (error, [dataclasses.astuple(e) for e in entries]), group=group)

        outcome: str | bytes = ""
        if rank == 0:
            failed = dict.fromkeys(err for err, _ in reports if err)  # DCP reports the same on every rank
            if failed:
                outcome = "; ".join(failed)
            else:
                try:
                    files = [FileEntry(*e) for _, es in reports for e in es]
                    outcome = self._commit(step, reason, files, staged.extra, deadline)
                except Exception as e:
                    outcome = f"rank 0: manifest not written: {type(e).__name__}: {e}"
        outcome = broadcast(outcome, group)
        if isinstance(outcome, str):
            if f"{LeaseLostError.__name__}: " in outcome:  # every rank stops alike: the run has another writer
                raise LeaseLostError(f"sharded checkpoint of step {step} not committed: {outcome}")
            raise StorageError(f"sharded checkpoint of step {step} not committed: {outcome}")
        return self._committed(outcome, step, reason)
