"""spotguard for Lightning: a ``Callback`` (``pip install 'spotguard[lightning]'``).

    cb = SpotguardCallback("s3://bucket/runs/1")
    trainer = L.Trainer(max_steps=10_000, callbacks=[cb])
    sys.exit(cb.fit(trainer, model, datamodule=dm))  # ckpt_path = newest verified; 75 after a notice

Flag-based: the signal handler and the metadata pollers only raise a flag (spotguard's
``Watcher``). At the next ``on_train_batch_end`` the callback sets ``trainer.should_stop``, writes
``trainer.save_checkpoint`` into a scratch folder and commits it to spotguard storage (the file,
then a manifest with its SHA-256). A notice during validation cuts it short and the checkpoint is
written from ``on_exception`` (as Lightning's ``OnExceptionCheckpoint`` does); a notice before
the first step of a resumed run stops it at once, its state being the checkpoint it resumed from.

With ``deadline_policy="use-window"`` training goes on after that first emergency checkpoint (the
callback lifts ``trainer.should_stop`` again) until one more step would leave too little time for a second
one before the deadline; that one is written the same way and the fit stops. No periodic save between.

Lightning does not save the global RNG streams; this callback's state does (in the ``.ckpt``), restored
where an uninterrupted run had them. Data positions: torchdata's ``StatefulDataLoader``, saved by Lightning.

Under torchrun (``strategy="ddp"``) the ranks vote after every optimizer step (one all-reduce of
one integer), so a notice seen by one rank stops all after the same step. Lightning writes only
rank 0's ``.ckpt``, but seeds each rank's dropout apart: every rank also writes its RNG streams
(``rng-rank-NNNNN.pt``) and the folders of all ranks are committed as one checkpoint. Lightning's
own SIGTERM handling (a broadcast from inside its signal handler, a stop on the rank that got the
signal) is bypassed in a process group: the vote does its job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spotguard.checkpoint.files.stream import pinned_torch_save
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.state import data, state
from spotguard.heartbeat import EVALUATING, EXIT_PREEMPTED, SAVING, marking

from ..coordination.agreement import ADVISORY, STOP
from ..coordination.options import check_every_steps, check_flag
from ..errors import PERMANENT, MissingDependencyError
from ..storage import Storage
from . import _lightning_loops as loops
from . import _rankfiles
from . import _untracked as untracked
from ._common import StopOutcome, exit_refused, watch_parts
from ._planned_resume import PlannedResume

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError as e:
    raise MissingDependencyError(
        "spotguard.integrations.lightning needs lightning: pip install 'spotguard[lightning]'"
    ) from e

logger = logging.getLogger(__name__)

__all__ = ["SpotguardCallback"]

CKPT_NAME = "lightning.ckpt"


def rng_file(rank: int) -> str:
    """Each rank's RNG streams beside the ``.ckpt`` (in a process group)."""
    return f"rng-rank-{rank:05d}.pt"


class _Interrupt(Exception):
    """Raised from a hook to leave ``trainer.fit`` where Lightning offers no way out (validation, warm-up)."""


class SpotguardCallback(StopOutcome, Callback):
    """Stops a Lightning ``Trainer`` after the current step on a notice, commits its checkpoint, resumes verified ones.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``); ``keep``
    checkpoints are kept there. ``every_steps``: periodic checkpoints through the same path (None:
    only on notices). ``save_on_exit``: a fit no notice stopped commits its last step (the finished
    model is in the storage, not only on the machine). ``providers``/``interval``/``stop_on_advisory``/
    ``deadline_policy``/``window_margin``: as for ``spotguard.Guard``.
    """

    @marking  # a bad option or URL: `spotguard run` exits 78
    def __init__(
        self,
        storage: str | Storage | None = None,
        *,
        every_steps: int | None = None,
        save_on_exit: bool = True,
        **kw: Any,
    ) -> None:
        check_every_steps(every_steps)
        check_flag("save_on_exit", save_on_exit)
        self.checkpoints, self.notices = watch_parts(storage, kw, "SpotguardCallback (Lightning)")
        self.every_steps, self.save_on_exit = every_steps, save_on_exit
        #: The step this run stopped at for a notice (its checkpoint committed when ``emergency_error`` is None).
        self.stopped_at: int | None = None
        self._save_s: float | None = None  # how long the last checkpoint took (the notice window's reserve)
        self._trainer: Any = None
        self._resumed_step, self._max_steps = 0, -1  # max_steps read once (a chain of properties): -1, none
        self._committed_step: int | None = None  # the last step this run committed
        self._steps = self._seen_steps = 0  # optimizer steps (as trainer.global_step), and the last one acted on
        self._rng_before_validation: dict[str, Any] | None = None
        self._rng_after_iterator: dict[str, Any] | None = None  # restored again once the resumed loader exists
        self._resume_folder: Path | None = None
        self._validation_next = False  # the save in progress is of a step whose validation has not run yet
        self._planned = PlannedResume(self.checkpoints, RankFiles(_rankfiles.lightning))
        self._saved: tuple[int | None, list[str]] | None = None  # (step, what) the checkpoint being loaded holds
        self._loader_facts: dict[str, Any] = {}  # the train loaders' worker counts and batch sizes, as saved

    @property
    def state_key(self) -> str:
        return "spotguard"

    # -- the user's side ---------------------------------------------------------------------
    def resume_from_checkpoint(self) -> str | None:
        """The newest checkpoint that verifies, as a local ``.ckpt`` path for ``trainer.fit(ckpt_path=...)``."""
        planned = self._planned.plan()  # under torchrun: fetched per node in ``setup``, once the group is up
        if planned is not None:
            self._resume_folder = planned
            return str(planned / CKPT_NAME)
        found = self.checkpoints.newest_verified(self._planned.rule)
        self._planned.step = found[0] if found else None
        self._resume_folder = found[1] if found else None
        return str(found[1] / CKPT_NAME) if found else None

    def fit(self, trainer: Any, model: Any, **kwargs: Any) -> int:
        """``trainer.fit`` from the newest verified checkpoint; returns the job's exit code (75 after a notice)."""
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)
        kwargs.setdefault("weights_only", True)  # torch.load's safe mode: the checkpoint holds no code
        try:
            try:
                ckpt_path = self.resume_from_checkpoint()
            except PERMANENT as e:  # a restart would meet it again: say so to `spotguard run` (no retry)
                return exit_refused(e)
            trainer.fit(model, ckpt_path=ckpt_path, **kwargs)
        except (_Interrupt, SIGTERMException):
            if self.stopped_at is None:
                raise
        except PERMANENT as e:
            if not (self._planned.failed or self.checkpoints.refused):
                raise
            return exit_refused(e)
        finally:
            self.close()
        return self.exit_code

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice (or Lightning's own SIGTERM stop), else 0."""
        return EXIT_PREEMPTED if self.stopped_at is not None or self.notices.exit_code else 0

    def close(self) -> None:
        self.notices.stop()
        self.checkpoints.cleanup()
        self.checkpoints.release()
        self.notices.group.close()

    # -- checkpoint state: the RNG streams Lightning leaves out ------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Saved mid-validation, the resumed run repeats the validation: give it the streams it started with.
        loaders = data.loader_facts(loops.train_loaders(self._trainer))  # what a resume compares
        return {"rng": self._rng_before_validation or state.capture_rng(), "loaders": loaders}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Saved during a validation, or at a step whose validation comes next: the resumed run runs
        it from its first batch, from the streams it starts with (``state_dict``)."""
        begun = self._rng_before_validation is not None
        if begun or self._validation_next:
            loops.rewind_validation(checkpoint, begun)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Set now, and again once the resumed loader's first iterator exists (on_train_start): the
        # uninterrupted run created no iterator at this point, so creating one must leave no trace.
        rng, self._loader_facts = state_dict["rng"], state_dict.get("loaders", {})
        own = self._resume_folder / rng_file(self._rank()) if self._resume_folder is not None else None
        if own is not None and own.is_file():  # saved in a process group: this rank's own streams
            rng = torch.load(own, weights_only=True)
        state.restore_rng(rng)
        self._rng_after_iterator = rng

    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    # -- Lightning events --------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._planned.fetch()  # the planned resume's copy, before Lightning reads it
            self._trainer = trainer
            loops.wrap_validation(trainer, lambda run: self._validate(trainer, run))
            loops.check_loader_states(trainer, self._check_loaders)  # as Guard: worker count, batch size; epoch end
            self.notices.start()  # before Lightning's own SIGTERM handler, which then calls ours too

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if getattr(trainer.state, "fn", None) != "fit":  # validate/test(ckpt_path=...) restore no optimizer
            return
        self._saved = (checkpoint.get("global_step"), untracked.lightning_saved(checkpoint))
        if trainer.strategy.restore_checkpoint_after_setup:  # the optimizers exist already
            self.on_fit_start(trainer, pl_module)

    def _check_loaders(self, loaders: dict[str, Any], states: dict[str, Any]) -> None:
        where = f"checkpoint of step {self._trainer.global_step if self._trainer is not None else '?'}"
        self.checkpoints.check_loaders(loaders, states, self._loader_facts, where)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._saved is not None:  # before Lightning restores the optimizers (it drops extra ones silently)
            (step, saved), self._saved = self._saved, None
            where = f"checkpoint of step {step}"
            self.checkpoints.refuse_untracked(
                saved, untracked.lightning_tracked(trainer), where, untracked.LIGHTNING_FIX
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.checkpoints.group.get() is not None:
            loops.bypass_lightning_sigterm(trainer)  # the vote stops every rank at the same step
        self.checkpoints.loaded()  # every rank has loaded its node's copy (collective in a group)
        self._resumed_step = self._steps = self._seen_steps = trainer.global_step
        self._max_steps = trainer.max_steps
        if self._rng_after_iterator is not None:
            state.restore_rng(self._rng_after_iterator)
            self._rng_after_iterator = None
        loops.settle_the_restarted_epoch(trainer)  # resumed at an epoch's last batch or end: end_the_epoch_once

    # The hooks below run on every rank at the same point, and so does every ``check`` (a
    # collective in a process group): their conditions depend on nothing one rank sees alone.
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._steps == self._resumed_step and self.notices.check(self._steps, stop_only=True) == STOP:
            raise _Interrupt  # a notice before the first step: the state is the resume point, stop now

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._steps += 1  # our own count: trainer.global_step is a chain of properties, too slow per batch

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._steps == self._seen_steps:
            return  # accumulating gradients: no optimizer step yet, nothing to stop or save at
        self._seen_steps = self._steps
        verdict = self.notices.check(self._steps)
        if verdict == STOP:
            self._stop(trainer)
        elif verdict == ADVISORY:
            self._save(trainer, "advisory", batch_end=True)
        elif (
            self.every_steps
            and self._steps % self.every_steps == 0
            and trainer.global_step != self._committed_step
            and not self.notices.in_window  # the second stop's checkpoint comes soon
        ):
            self._save(trainer, "periodic", batch_end=True)
        if 0 < self._max_steps <= self._steps:
            self._final(trainer, batch_end=True)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.notices.marks.hold(EVALUATING, self._steps)  # when the loop could not be wrapped
            if self._rng_before_validation is None:
                self._rng_before_validation = state.capture_rng()

    def _validate(self, trainer: Any, run: Callable[[], Any]) -> Any:
        """Run one validation of ``fit`` (``loops.wrap_validation``), its streams captured before its
        loader's iterator exists: ``on_validation_start`` comes after Lightning created that
        iterator, and creating one draws (a loader's base seed), so a validation repeated from
        streams captured there would draw once more than the uninterrupted run did."""
        if trainer.sanity_checking:
            return run()
        if self.stopped_at is not None:  # Lightning validates at a stop as at an early stop; the uninterrupted
            return []  # run did not (a validation due here is the resumed run's first: the checkpoint says so)
        self._rng_before_validation = state.capture_rng()
        with self.notices.marks.during(EVALUATING, self._steps):  # also when a notice cuts it short
            return run()

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not trainer.sanity_checking and self.notices.check(self._steps, stop_only=True) == STOP:
            raise _Interrupt  # cut the validation short: the checkpoint must make the deadline

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._rng_before_validation = None
        self.notices.marks.release(EVALUATING)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not isinstance(exception, (_Interrupt, SIGTERMException)):
            return
        self.notices.marks.release(EVALUATING)  # a validation cut short has ended (the save is no part of it)
        if self.stopped_at is None:
            self.stopped_at = step = trainer.global_step
            where = "during validation" if self._rng_before_validation is not None else "outside a training step"
            self.notices.emergency(
                step,
                step in (self._resumed_step, self._committed_step),
                lambda deadline: self._write(trainer, "emergency", deadline=deadline),
                None,  # Lightning has left its loop: no notice window
                self._committed_step,
                where=f"{where} after step",
                may_train_on=False,
            )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # a fit that ended another way: epochs, early stop
        self._final(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._trainer = None
            self.close()

    # -- inside ------------------------------------------------------------------------------
    def _stop(self, trainer: Any) -> None:
        trainer.should_stop = True
        if self.stopped_at is None:
            step = self.stopped_at = trainer.global_step
            train_on = self.notices.emergency(
                step,
                step == self._committed_step,
                lambda deadline: self._write(trainer, "emergency", batch_end=True, deadline=deadline),
                self._save_s,
                self._committed_step,
            )
            if train_on:  # the notice window: train on, checkpoint again before the deadline
                trainer.should_stop = False
                self.stopped_at = None

    def _final(self, trainer: Any, batch_end: bool = False) -> None:
        """``save_on_exit`` (at ``max_steps``, at the batch's end as a stop saves). Raises, as ``Guard``'s does."""
        step = trainer.global_step
        if self.save_on_exit and self.stopped_at is None and step > 0 and step != self._committed_step:
            self._write(trainer, "final", batch_end=batch_end)

    def _save(self, trainer: Any, reason: str, batch_end: bool = False) -> None:
        """A periodic or advisory checkpoint of this step; one that fails is logged, training goes on."""
        try:
            self._write(trainer, reason, batch_end)
        except Exception as e:  # a failed periodic save must not end the training
            step, name = trainer.global_step, type(e).__name__
            logger.error("%s checkpoint of step %d NOT committed (%s: %s)", reason, step, name, e)

    def _write(self, trainer: Any, reason: str, batch_end: bool = False, deadline: float | None = None) -> None:
        """Write and commit a checkpoint of this step (``deadline``: the emergency one's), or raise."""
        step = trainer.global_step
        t0 = time.monotonic()
        self._validation_next = batch_end and loops.validation_due(trainer)
        with self.notices.marks.during(SAVING, step), self.checkpoints.storage.scratch() as scratch:
            folder = scratch / "lightning"
            try:
                with pinned_torch_save():  # device tensors copied through pinned memory (CUDA)
                    trainer.save_checkpoint(str(Path(folder) / CKPT_NAME), weights_only=False)  # the full state
            finally:
                self._validation_next = False
            if self.checkpoints.group.get() is not None:  # Lightning wrote rank 0's streams only
                folder.mkdir(parents=True, exist_ok=True)
                torch.save(self._rng_before_validation or state.capture_rng(), folder / rng_file(trainer.global_rank))
            logger.debug("save_checkpoint of step %d took %.2fs", step, time.monotonic() - t0)
            self.checkpoints.commit(step, folder, reason, deadline, supersede=reason == "final")
        self._committed_step = step
        self._save_s = time.monotonic() - t0
