"""spotguard for DeepSpeed: ``engine.save_checkpoint``/``load_checkpoint`` made safe on spot machines.

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    guard = DeepSpeedGuard(engine, "s3://bucket/runs/1", every_steps=500)
    guard.track(loader=loader)           # per rank: a StatefulDataLoader's position, counters
    step = guard.resume()                # engine.load_checkpoint(<newest verified checkpoint>)
    with guard:                          # watches for notices; a clean exit writes a final checkpoint
        for batch in loader:
            ...                          # engine(batch), engine.backward(loss), engine.step()
            step += 1
            if guard.step(step):         # on every rank; one vote per step in a process group
                break                    # a notice on any rank: every rank stops after this step
    sys.exit(guard.exit_code)            # 75 after a notice

Every save is ``engine.save_checkpoint(folder, tag="step<N>")`` on every rank, each into a scratch
folder of its own (no shared filesystem assumed), plus one small file per rank beside DeepSpeed's
files: the tracked objects' state (the data position), every RNG stream of that rank (dropout
streams differ between ranks) and ``guard.extra``. The folders of all ranks are committed as one
checkpoint ``step-N/``, the manifest written last once every rank stored its files. ``resume()``
fetches the newest checkpoint that verifies (one copy per node) and loads it with
``engine.load_checkpoint`` on every rank, then restores each rank's own file. ZeRO stages 0-3.

spotguard's per-rank files load with ``torch.load(weights_only=True)`` (checked at the first save on
every rank, ``spotguard.checkpoint.state.loadable``, naming what does not); DeepSpeed's own files hold pickled objects and DeepSpeed loads them with
``weights_only=False``: the manifest's checksums are verified before they are read.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from spotguard import heartbeat
from spotguard.checkpoint.collective import agree
from spotguard.checkpoint.files.stream import pinned_torch_save
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.state import data, loadable, state

from ..coordination import ranks
from ..errors import CheckpointMismatchError, ConfigError, UnloadableStateError
from ..storage import Storage
from . import _rankfiles
from ._loop import LoopGuard

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedGuard", "rank_file", "tag_for"]


def tag_for(step: int) -> str:
    """DeepSpeed's tag (the subfolder) of checkpoint ``step``."""
    return f"step{step}"


def rank_file(rank: int) -> str:
    """spotguard's file of one rank, in the tag's subfolder beside DeepSpeed's files."""
    return f"spotguard-rank{rank}.pt"


def fetch_rule(engine: Any, world: int) -> RankFiles:
    """Which files a node fetches for a resume (``_rankfiles.deepspeed``), and when that rule is unsure:
    DeepSpeed names ZeRO files by data-parallel rank, and reads the other ranks' ones with its elastic
    checkpoint or a universal checkpoint load; then every node fetches every file."""
    doubt = ""
    parallel = [
        getattr(engine, k, d) for k, d in (("mp_world_size", 1), ("dp_world_size", world), ("seq_dp_world_size", world))
    ]
    if _call(engine, "zero_elastic_checkpoint"):
        doubt = _rankfiles.ELASTIC
    elif _call(engine, "load_universal_checkpoint"):
        doubt = _rankfiles.UNIVERSAL
    elif getattr(engine, "has_moe_layers", False):
        doubt = _rankfiles.EXPERTS
    elif parallel != [1, world, world]:
        doubt = _rankfiles.PARALLEL
    return RankFiles(_rankfiles.deepspeed, doubt)


def _call(engine: Any, name: str) -> bool:
    method = getattr(engine, name, None)
    return bool(method()) if callable(method) else False


#: How a DeepSpeedGuard restores an object (``state.refuse_untracked``'s ``fix``).
FIX = "Give deepspeed.initialize the optimizer and lr_scheduler it saved, track the rest with guard.track(name=obj)"


def _engine_parts(engine: Any) -> list[str]:
    """The parts of ``engine`` whose state ``load_checkpoint`` restores only when the engine has them."""
    return [f"engine.{part}" for part in ("optimizer", "lr_scheduler") if getattr(engine, part, None) is not None]


class DeepSpeedGuard(LoopGuard):
    """Checkpoints a DeepSpeed engine's training loop periodically and on a notice; resumes it exactly.

    ``engine``: what ``deepspeed.initialize`` returned first. ``storage``: a path or ``s3://``/``gs://``
    URL (default ``$SPOTGUARD_STORAGE``); ``keep`` checkpoints are kept there. ``every_steps``:
    periodic checkpoints (None: only on notices and at the end). ``save_on_exit``, ``providers``,
    ``work_dir`` ... (``LoopOptions``): as for ``spotguard.Guard``. Call ``step`` at gradient
    accumulation boundaries only: a checkpoint does not hold half-accumulated gradients.
    """

    @heartbeat.marking  # a bad option or URL: `spotguard run` exits 78
    def __init__(self, engine: Any, storage: str | Storage | None = None, **options: Any) -> None:
        if not callable(getattr(engine, "save_checkpoint", None)) or not callable(
            getattr(engine, "load_checkpoint", None)
        ):
            raise ConfigError(
                f"DeepSpeedGuard needs the engine deepspeed.initialize returned, got {type(engine).__name__}"
            )
        super().__init__(storage, options)
        self.engine = engine
        #: Saved and restored with each rank's state (values that load with ``weights_only=True``).
        self.extra: dict[str, Any] = {}
        self._objects: dict[str, Any] = {}
        self._checked = False  # the first save checks that spotguard's files load with weights_only=True

    def track(self, **objects: Any) -> DeepSpeedGuard:
        """Save and restore ``objects`` per rank: a ``StatefulDataLoader`` (its position), anything with
        ``state_dict()``/``load_state_dict()``, or a tensor, dict or list (restored in place)."""
        for name, obj in objects.items():
            data.warn_if_plain_loader(name, obj)
            self._objects[name] = state.trackable(name, obj)
        return self

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        """``engine.save_checkpoint`` and every rank's own state, committed as checkpoint ``step``, now.

        Collective: every rank calls it at the same step (``step()`` does)."""
        rank = ranks.rank()
        with self.notices.marks.during(heartbeat.SAVING, step), self.checkpoints.storage.scratch() as scratch:
            folder = scratch / "deepspeed"
            # ZeRO-0: DeepSpeed writes nothing on rank 1+; each file hashed as DeepSpeed closes it
            self.checkpoints.hash_on_close(folder / tag_for(step))
            t0 = time.monotonic()
            with pinned_torch_save():  # device tensors copied through pinned memory (CUDA)
                self.engine.save_checkpoint(str(folder), tag=tag_for(step))
            own = self._rank_state(step)
            self._check_loadable(own, step)
            torch.save(own, folder / tag_for(step) / rank_file(rank))
            logger.debug("save_checkpoint of step %d took %.2fs", step, time.monotonic() - t0)
            manifest = self.checkpoints.commit(step, folder, reason, deadline)
        self._saved(step)
        return manifest

    def _rank_state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "rank": ranks.rank(),
            "world_size": ranks.world_size(),
            "objects": state.collect(self._objects),
            "engine": _engine_parts(self.engine),  # what a resume's load_checkpoint must find to restore
            "loaders": data.loader_facts(self._objects),  # what a resume compares (worker count, batch size)
            "extra": dict(self.extra),
            "rng": state.capture_rng(),
        }

    def _check_loadable(self, own: dict[str, Any], step: int) -> None:
        """Once: every rank's state must load with ``weights_only=True``, or the save raises
        ``UnloadableStateError`` on every rank (naming each failing rank's object), before any commit."""
        if self._checked:
            return
        error: UnloadableStateError | None = None
        try:
            loadable.check({**own["objects"], "guard.extra": own["extra"], "RNG streams": own["rng"]})
        except UnloadableStateError as e:
            error = e
        agreed = self.checkpoints.group.get()
        if agreed is not None:
            agree(agreed, f"the checkpoint of step {step}", error, what="cannot be written")
        elif error is not None:
            raise error
        self._checked = True

    # -- resuming ----------------------------------------------------------------------------
    def resume(self) -> int:
        """``engine.load_checkpoint`` from the newest checkpoint that verifies, and every rank's own state;
        return its step (0 if none). Collective: every rank loads the same step, from its node's copy."""
        found = self.checkpoints.newest_verified(fetch_rule(self.engine, ranks.world_size()))
        if found is None:
            return 0
        step, folder = found
        try:
            own = self._load(step, folder)
        except BaseException:
            self.checkpoints.cleanup()
            raise
        self.checkpoints.loaded()
        state.restore(self._objects, own["objects"], where=f"checkpoint of step {step}")
        self.extra.clear()
        self.extra.update(own["extra"])
        for obj in self._objects.values():
            if data.is_stateful_loader(obj):
                # Its first iterator after the restore must not draw from the streams restored below:
                # the uninterrupted run created it at the start of the epoch, not here.
                data.neutralize_next_iterator(obj)
        state.restore_rng(own["rng"])  # last: nothing after it draws
        self._resumed(step)
        return step

    def _load(self, step: int, folder: Path) -> dict[str, Any]:
        tag, rank, world = tag_for(step), ranks.rank(), ranks.world_size()
        saved = sorted(p.name for p in (folder / tag).glob("spotguard-rank*.pt"))
        if not saved:
            raise CheckpointMismatchError(
                f"checkpoint of step {step} was not written by DeepSpeedGuard (no {tag}/{rank_file(0)})"
            )
        # A node holds its own ranks' files only when the world size is the checkpoint's (else every
        # rank's: ``fetch_rule``): each rank's own file says how many ranks saved (the same on every rank).
        mine = folder / tag / rank_file(rank)
        own: dict[str, Any] | None = torch.load(mine, weights_only=True) if mine.is_file() else None
        saved_world = len(saved) if own is None else int(own.get("world_size", len(saved)))
        error = None
        if saved_world != world or own is None:
            error = CheckpointMismatchError(
                f"checkpoint of step {step} was saved by {saved_world} ranks, this job has {world}: each rank's "
                "data position and RNG streams cannot be split or merged; resume it with the same world size"
            )
        else:  # DeepSpeed skips a saved optimizer or scheduler the engine lacks without a word
            saved = [*own["objects"], *own.get("engine", [])]
            tracked = [*self._objects, *_engine_parts(self.engine)]
            try:
                self.checkpoints.refuse_untracked(saved, tracked, f"checkpoint of step {step}", FIX)
                self.checkpoints.check_loaders(
                    self._objects, own["objects"], own.get("loaders", {}), f"checkpoint of step {step}"
                )
            except CheckpointMismatchError as e:
                error = e
        agreed = self.checkpoints.group.get()
        if agreed is not None:  # no rank enters load_checkpoint's collectives alone
            agree(agreed, f"the checkpoint of step {step}", error)
        elif error is not None:
            raise error
        assert own is not None
        path, _ = self.engine.load_checkpoint(str(folder), tag=tag)
        if path is None:
            raise CheckpointMismatchError(f"DeepSpeed found no checkpoint in {folder / tag}")
        return own
