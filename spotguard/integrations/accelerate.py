"""spotguard for Hugging Face Accelerate: ``accelerator.save_state``/``load_state`` made safe on spot machines.

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    guard = AcceleratorGuard(accelerator, "s3://bucket/runs/1", every_steps=500)
    guard.track(counter)                 # accelerator.register_for_checkpointing(counter)
    step = guard.resume()                # accelerator.load_state(<newest verified checkpoint>)
    with guard:                          # watches for notices; a clean exit writes a final checkpoint
        for batch in loader:
            ...                          # one training step
            step += 1
            if guard.step(step):         # nearly free when nothing is due
                break                    # a notice came: the emergency checkpoint is committed
    sys.exit(guard.exit_code)            # 75 after a notice

An evaluation between two steps is left early through ``guard.evaluation()`` (as for ``Guard``):
the checkpoint of the last training step then holds the RNG streams as the evaluation found them
and the loaders as at their last batch, and ``guard.resumed_in_evaluation`` tells the resumed run
to run that evaluation again first.

Every save is ``accelerator.save_state`` into a scratch folder (on the storage's filesystem for a
local path, so storing it is a hard link), committed as ``step-N/`` with a manifest written last;
``resume()`` loads the newest folder whose files match their manifest. Accelerate saves the
model, optimizers, schedulers, registered objects, the RNG streams and, with
``use_stateful_dataloader=True``, the data loader's position: the resumed run continues exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spotguard import heartbeat
from spotguard.checkpoint.engine import Cut, Tracked
from spotguard.checkpoint.files.stream import pinned_torch_save
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.checkpoint.state import data, state

from ..coordination.evaluation import Evaluation
from ..errors import ConfigError
from ..storage import Storage
from . import _accelerate_loaders as loaders
from . import _rankfiles
from . import _untracked as untracked
from ._loop import LoopGuard

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorGuard"]


class AcceleratorGuard(LoopGuard):
    """Checkpoints an Accelerate training loop periodically and on a notice, and resumes it exactly.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``); ``keep``
    checkpoints are kept there. ``every_steps``: periodic checkpoints (None: only on notices and
    at the end). ``save_on_exit``, ``providers``, ``interval`` ... (``LoopOptions``): as for ``spotguard.Guard``.
    """

    @heartbeat.marking  # a bad option or URL: `spotguard run` exits 78
    def __init__(self, accelerator: Any, storage: str | Storage | None = None, **options: Any) -> None:
        project = getattr(accelerator, "project_configuration", None)
        if getattr(project, "automatic_checkpoint_naming", False):
            raise ConfigError(
                "ProjectConfiguration(automatic_checkpoint_naming=True) makes save_state ignore its "
                "folder: turn it off, spotguard names, commits and prunes the checkpoints"
            )
        super().__init__(storage, options)
        self.accelerator = accelerator
        self._evaluations = Tracked({}, {})  # holds the cut of the latest guard.evaluation()
        #: The checkpoint ``resume()`` loaded was written inside an evaluation cut short by a notice:
        #: run that evaluation again, from its start, before the next training step.
        self.resumed_in_evaluation = False
        self._saved_cut = False  # the committed checkpoint of ``_saved_step`` holds a cut evaluation

    def track(self, *objects: Any) -> AcceleratorGuard:
        """Save and restore ``objects`` too (``accelerator.register_for_checkpointing``)."""
        self.accelerator.register_for_checkpointing(*objects)
        return self

    def resume(self) -> int:
        """``accelerator.load_state`` from the newest checkpoint that verifies; return its step (0 if none).

        Collective under ``accelerate launch``: every rank loads the same step, from its node's copy."""
        for i, loader in enumerate(getattr(self.accelerator, "_dataloaders", [])):  # as Guard.track() warns
            data.warn_if_plain_loader(
                f"prepared loader {i}", getattr(loader, "base_dataloader", loader), data.ACCELERATE_HINT
            )
        found = self.checkpoints.newest_verified(RankFiles(_rankfiles.accelerate))
        if found is None:
            return 0
        step, folder = found
        prepared = getattr(self.accelerator, "_dataloaders", [])
        try:
            saved, tracked = untracked.accelerate(folder, self.accelerator)
            self.checkpoints.refuse_untracked(saved, tracked, f"checkpoint of step {step}", untracked.ACCELERATE_FIX)
            where, index = f"checkpoint of step {step}", self.accelerator.process_index
            moved = loaders.check(prepared, folder, index, self.checkpoints, where)  # as Guard: workers, batch size
            self.accelerator.load_state(str(folder))
            loaders.reload(prepared, moved)
            cut = loaders.restore(prepared, folder, index)
        except BaseException:
            self.checkpoints.cleanup()
            raise
        self.checkpoints.loaded()
        loaders.watch(prepared)
        for loader in getattr(self.accelerator, "_dataloaders", []):
            # Its first iterator after the restore must not draw from the RNG streams just restored:
            # the uninterrupted run created it at the start of the epoch, not here.
            base = getattr(loader, "base_dataloader", loader)
            if data.is_stateful_loader(base):
                data.neutralize_next_iterator(base)
        self.resumed_in_evaluation = self._saved_cut = cut
        if cut:
            logger.warning("resumed inside the evaluation after step %d that a notice cut short: run it again", step)
        self._resumed(step)
        return step

    def evaluation(self, step: int | None = None) -> Evaluation:
        """Mark an evaluation run after training step ``step`` (default: the last one passed to ``step()``);
        leave it when ``should_stop()`` says so.

        ::

            with guard.evaluation() as ev:
                for batch in val_loader:
                    if ev.should_stop():   # the same answer on every rank (one all-reduce in a group)
                        break
                    ...
            if guard.step(step):           # the same step again: the emergency checkpoint, then stop
                break

        That checkpoint holds the RNG streams as the evaluation found them and each prepared loader
        as at its last batch; after ``resume()``, ``resumed_in_evaluation`` is True: run the
        evaluation again first, and the resumed run draws as the uninterrupted one did. A checkpoint
        of that step committed before the evaluation (``guard.step(step)`` saved, then the loop
        evaluated) is replaced: the stop commits the cut state as the step's next revision.
        """
        at = self._step if step is None else step
        notices = self.notices
        stopping = lambda: notices.preempted.is_set() and not notices.in_window  # noqa: E731
        return Evaluation(self._evaluations, at, stopping, self.checkpoints.group.get(), self.notices.marks)

    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        """``accelerator.save_state`` of the current state, committed as checkpoint ``step``, now.

        Collective in a process group: each rank saves into a scratch folder of its own (no shared
        filesystem assumed) and the folders are committed as one checkpoint."""
        cut = self._evaluations.cut_at(step, final=reason == "final")
        # A checkpoint of this step committed before the evaluation a notice cut short (a periodic one:
        # the loop saved, then evaluated): resumed from it, the run would skip the evaluation and its draws.
        # This one replaces it, as the step's next revision (the old one stays until this one is committed).
        supersede = cut is not None and step == self._saved_step and not self._saved_cut
        if supersede:
            logger.warning(
                "%s checkpoint of step %d: the committed one was written before the evaluation a notice cut "
                "short; committing the evaluation's state in its place",
                reason,
                step,
            )
        prepared = getattr(self.accelerator, "_dataloaders", [])
        with self.notices.marks.during(heartbeat.SAVING, step), self.checkpoints.storage.scratch() as scratch:
            folder = scratch / "state"
            self.checkpoints.hash_on_close(folder)  # each file hashed as Accelerate closes it
            t0 = time.monotonic()
            with _as_at(cut, prepared), pinned_torch_save():  # device tensors through pinned memory (CUDA)
                self.accelerator.save_state(str(folder))
                loaders.save(prepared, folder, self.accelerator.process_index, cut=cut is not None)
            logger.debug("save_state of step %d took %.2fs", step, time.monotonic() - t0)
            manifest = self.checkpoints.commit(step, folder, reason, deadline, supersede=supersede)
        if manifest is not None or step != self._saved_step:
            self._saved_cut = cut is not None
        self._saved(step)
        return manifest

    def _holds(self, step: int) -> bool:
        # Not a checkpoint written before the evaluation that a notice is cutting short now (``save``).
        return super()._holds(step) and (self._saved_cut or self._evaluations.cut_at(step) is None)

    def __enter__(self) -> AcceleratorGuard:
        loaders.watch(getattr(self.accelerator, "_dataloaders", []))
        return super().__enter__()


@contextmanager
def _as_at(cut: Cut | None, prepared: list[Any]) -> Iterator[None]:
    """During a save inside a cut evaluation: the RNG streams as it found them (``save_state`` pickles
    the global ones) and each prepared loader's state as at its last batch; all back afterwards."""
    if cut is None:
        yield
        return
    kept = {
        str(i): dl
        for i, loader in enumerate(prepared)
        if isinstance(dl := getattr(loader, "dl_state_dict", None), dict)
    }
    at_last_batch = dict(kept)
    data.as_at_last_batch({i: prepared[int(i)].base_dataloader for i in kept}, at_last_batch)
    now = state.capture_rng()
    try:
        state.restore_rng(cut.rng)
        for i, dl in at_last_batch.items():
            prepared[int(i)].dl_state_dict = dl  # what ``state_dict()`` returns to ``save_state``
        yield
    finally:
        for i, dl in kept.items():
            prepared[int(i)].dl_state_dict = dl
        state.restore_rng(now)
