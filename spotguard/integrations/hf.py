"""spotguard for the Hugging Face ``Trainer``: a ``TrainerCallback`` (``pip install 'spotguard[hf]'``).

    cb = SpotguardCallback("s3://bucket/runs/1")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    sys.exit(cb.train(trainer))   # resumes from the newest verified checkpoint; 75 after a notice

What happens, in the Trainer's own order: a notice (SIGTERM, cloud metadata) raises a flag; at the
next ``on_step_end`` the callback sets ``control.should_save`` and ``should_training_stop``, so
the Trainer finishes the step and writes its own ``checkpoint-N/`` folder; in ``on_save`` that
folder is committed to spotguard storage (files, then a manifest with SHA-256, last) and the
Trainer stops. Every save the Trainer makes for itself (``save_steps``) is committed the same way,
so the storage always holds folders that verify. The resume goes the other way: the newest
``step-N/`` whose files match their manifest is fetched and handed to ``trainer.train(
resume_from_checkpoint=...)``, which restores model, optimizer, scheduler, RNG streams and the
data position itself; a folder cut short by a kill has no manifest and is skipped.

With ``deadline_policy="use-window"`` the Trainer goes on after that first emergency checkpoint (``on_save``
lifts ``should_training_stop`` again) until one more step would leave too little time for a second one
before the deadline; that one is written the same way, and the Trainer stops. No periodic save between.

A notice that comes while no training step runs: during an evaluation, it is cut short (``cb.train`` only;
with a bare callback it runs to its end) and the checkpoint written at once; before the first step of this
run (loading, warm-up), the run stops at once when its state is the one resumed, else after its first step.

Under torchrun (DDP) every rank runs the callback: the ranks vote at each step end (one all-reduce of one
integer), so a notice seen by one rank stops all after the same step; the Trainer's save runs on every rank,
and the folders of all ranks (of all nodes, with no shared filesystem) are committed as one checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from spotguard import checkpoint
from spotguard.checkpoint.files.onclose import replace_text
from spotguard.checkpoint.files.stream import pinned_torch_save
from spotguard.checkpoint.folders.folders import is_node_leader
from spotguard.checkpoint.state import data
from spotguard.checkpoint.state import state as state_module

from ..coordination.agreement import ADVISORY, STOP
from ..errors import PERMANENT, MissingDependencyError
from ..heartbeat import EVALUATING, SAVING, marking
from ..storage import Storage
from . import _rankfiles
from . import _untracked as untracked
from ._common import StopOutcome, exit_refused, saved_already, watch_parts
from ._folders import unlink_linked_ahead

try:
    from transformers import TrainerCallback
except ImportError as e:
    raise MissingDependencyError("spotguard.integrations.hf needs transformers: pip install 'spotguard[hf]'") from e

logger = logging.getLogger(__name__)

__all__ = ["SpotguardCallback"]

#: What the Trainer does when resumed with another batch size (``rebatch="accept"``): it skips the steps done.
HF_REBATCH = "the Trainer counts the steps done as batches of the new size, so it continues at another sample"

#: In a checkpoint written during an evaluation: the resume runs that evaluation again first.
EVAL_CUT = "spotguard-evaluation-cut.json"


class _Interrupt(Exception):
    """Raised from a callback to leave ``Trainer.train`` where the Trainer offers no way out."""


class _Finished(_Interrupt):
    """Resumed at the run's last step: the Trainer would train one step past ``max_steps`` (it checks after)."""


class SpotguardCallback(StopOutcome, TrainerCallback):
    """Stops a ``Trainer`` after the current step on a notice, commits its checkpoints, resumes verified ones.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``); ``keep`` checkpoints are kept
    there. ``providers``/``interval``: what to watch and how often, as for ``spotguard.Guard``. ``stop_on_advisory``:
    stop on an advisory notice (rebalance, migrate) instead of only checkpointing early. ``work_dir``: where verified
    copies are fetched for a resume. ``deadline_policy``/``window_margin``: stop at the first emergency checkpoint,
    or train on in the notice window (``"use-window"``), as for ``spotguard.Guard``.
    """

    @marking  # a bad option or URL: `spotguard run` exits 78
    def __init__(self, storage: str | Storage | None = None, **options: Any) -> None:
        self.checkpoints, self.notices = watch_parts(storage, options, "SpotguardCallback (HF)")
        #: The step this run stopped at for a notice (its checkpoint committed when ``emergency_error`` is None).
        self.stopped_at: int | None = None
        self._trainer: Any = None
        self._resumed_step = 0
        self._committed_step: int | None = None
        self._reason: str | None = None
        self._rng_before_eval: dict[str, Any] | None = None  # while cb.train's Trainer evaluates
        self._replay_eval = False  # resumed from an evaluation cut short: run it again first
        self._replayed = False  # and it was run again
        self._save_began: float | None = None  # when the Trainer was asked to save (its own write counts)
        self._save_s: float | None = None  # how long the last checkpoint took (the notice window's reserve)

    # -- the user's side ---------------------------------------------------------------------
    def resume_from_checkpoint(self) -> str | None:
        """The newest checkpoint that verifies, as a local folder for ``trainer.train(resume_from_checkpoint=...)``."""
        # On each node: the shared files and its own ranks' ones.
        found = self.checkpoints.newest_verified(_rankfiles.trainer_files(self._trainer))
        self._resumed_step = found[0] if found else 0
        self._replay_eval = found is not None and (found[1] / EVAL_CUT).is_file()
        return str(found[1]) if found else None

    def train(self, trainer: Any, **kwargs: Any) -> int:
        """``trainer.train`` from the newest verified checkpoint; returns the exit code for the job.

        ``spotguard.EXIT_PREEMPTED`` (75) after a notice (the checkpoint is committed), else 0;
        ``spotguard.EXIT_CONFIG`` (78) when no checkpoint in the storage loads (``spotguard run``
        does not restart it). Other keyword arguments go to ``trainer.train``.
        """
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self._trainer = trainer
        evaluate, save_checkpoint, marks = trainer.evaluate, trainer._save_checkpoint, self.notices.marks

        def evaluate_from_its_start(*args: Any, **kw: Any) -> Any:
            # The RNG streams an evaluation starts with: a cut one is run again from them on resume.
            self._rng_before_eval = state_module.capture_rng()
            with marks.during(EVALUATING, trainer.state.global_step):  # `spotguard rehearse` sees it
                result = evaluate(*args, **kw)  # cut short (_Interrupt): the streams stay for the save
            self._rng_before_eval = None
            return result

        def save_marked(*args: Any, **kw: Any) -> Any:
            # The Trainer writes its folder here; the mark ends once ``_commit`` has committed it.
            marks.hold(SAVING, trainer.state.global_step)
            if is_node_leader():  # the rank that stores its node's files (a shared folder: all of them)
                self.checkpoints.hash_on_close(
                    Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
                )
            try:
                with pinned_torch_save():  # device tensors copied through pinned memory (CUDA)
                    return save_checkpoint(*args, **kw)
            except BaseException:
                marks.release(SAVING)
                raise

        trainer.evaluate, trainer._save_checkpoint = evaluate_from_its_start, save_marked
        try:
            try:
                resume = self.resume_from_checkpoint()
            except PERMANENT as e:  # a restart would meet it again: say so to `spotguard run` (no retry)
                return exit_refused(e)
            trainer.train(resume_from_checkpoint=resume, **kwargs)
        except _Finished:
            logger.info("resumed at step %d, the last (max_steps): nothing left to train", trainer.state.global_step)
            if self._replayed:
                self._save_final(trainer)
        except _Interrupt:
            self._save_interrupted(trainer)
        except PERMANENT as e:
            if not self.checkpoints.refused:  # refused in on_train_begin: no restart would fix it
                raise
            return exit_refused(e)
        finally:
            del trainer.evaluate, trainer._save_checkpoint  # the class's methods again
            self._trainer = None
            self.close()
        return self.exit_code

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice, else 0."""
        return self.notices.exit_code

    def close(self) -> None:
        """Stop watching and remove the fetched resume copy (``on_train_end`` does it too)."""
        self.notices.stop()
        self.checkpoints.cleanup()
        self.checkpoints.release()
        self.notices.group.close()

    # -- Trainer events ----------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resumed_step = state.global_step
        if state.global_step > 0:  # resumed: the Trainer restores callbacks' states only when asked to
            trainer = self._trainer
            saved = [name for name in state.stateful_callbacks or {} if name != "TrainerControl"]  # flags only
            restored = [type(cb).__name__ for cb in trainer.callback_handler.callbacks] if trainer else saved
            tracked = restored if args.restore_callback_states_from_checkpoint else []
            self.checkpoints.refuse_untracked(
                saved, tracked, f"checkpoint of step {state.global_step}", untracked.HF_FIX
            )
            with self.checkpoints.refusing():  # the Trainer keeps no loader state: its batch size, as Guard checks it
                size, now = state.train_batch_size, getattr(trainer, "_train_batch_size", None)
                where = f"checkpoint of step {state.global_step}"
                data.check_batch_size(where, "train", size, now, self.checkpoints.rebatch, HF_REBATCH)
        if is_node_leader() and self.checkpoints.storage.links_files:  # before any save: links are committed files
            unlink_linked_ahead(Path(args.output_dir), state.global_step)
        newest = checkpoint.latest(self.checkpoints.storage) if state.is_world_process_zero else None
        if newest is not None and newest.step > state.global_step:
            fix = "pass resume_from_checkpoint=callback.resume_from_checkpoint(), or use callback.train(trainer)"
            facts = (self.checkpoints.storage.describe(), newest.step, state.global_step, fix)
            logger.warning("%s holds step %d but training starts at step %d: %s", *facts)
        self.notices.start()

    # Every hook below runs on every rank at the same point, and so does every ``check`` (a
    # collective in a process group): their conditions depend on nothing one rank sees alone.
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None or state.global_step != self._resumed_step:
            return
        if self.notices.check(state.global_step, stop_only=True) == STOP:
            raise _Interrupt  # a notice before the first step: the state is the resume point, stop now
        if self._replay_eval:
            # The uninterrupted run evaluated here, drawing from the streams the checkpoint holds:
            # run that evaluation again (its metrics are logged), so the next step draws as it did.
            self._replay_eval, self._replayed = False, True
            logger.warning("running the evaluation of step %d again: a notice cut it short", state.global_step)
            self._trainer.evaluate()
        if 0 < state.max_steps <= state.global_step:
            raise _Finished

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self._act(self.notices.check(state.global_step), state, control) and (
            control.should_save and (state.global_step == self._committed_step or self.notices.in_window)
        ):
            control.should_save = False  # in the notice window: the second stop's checkpoint comes soon
        self._save_began = time.monotonic() if control.should_save else None
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stopped_at is not None:
            # The Trainer evaluates and saves at every epoch end, also after a stop mid-epoch: skip both.
            control.should_save = control.should_evaluate = False
        elif (
            not self._act(self.notices.check(state.global_step, tick=False), state, control) and self.notices.in_window
        ):
            control.should_save = False
        if control.should_save and state.global_step == self._committed_step:
            control.should_save = False  # committed files may be hard links: never rewrite them
        self._save_began = time.monotonic() if control.should_save else None
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.notices.marks.release(EVALUATING)
        if self.stopped_at is None and self._act(self.notices.check(state.global_step, tick=False), state, control):
            self._save_began = self._save_began or time.monotonic()  # the Trainer saves next
        return control

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.notices.marks.release(EVALUATING)

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A bare callback (no ``cb.train``) learns of an evaluation here first, after its first batch.
        self.notices.marks.hold(EVALUATING, state.global_step)
        if self._trainer is not None and self.notices.check(state.global_step, stop_only=True) == STOP:
            raise _Interrupt  # cut the evaluation short: the checkpoint must make the deadline

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step, reason = state.global_step, self._reason or "periodic"
        self._reason = None
        began, self._save_began = self._save_began, None
        if self._commit(step, Path(args.output_dir) / f"checkpoint-{step}", reason, began):
            control.should_training_stop = False  # the notice window: train on, checkpoint again before the deadline

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------
    def _act(self, verdict: int, state: Any, control: Any) -> bool:
        """Set the Trainer's controls for a verdict; False when there is nothing to do."""
        if verdict == STOP:
            if self.stopped_at is None:
                self.stopped_at = state.global_step
                self._reason = "emergency"
                control.should_save = state.global_step not in (self._resumed_step, self._committed_step)
                if not control.should_save:  # the resume point is safe (an evaluation at start: its step)
                    logger.warning("stop at step %d: %s", state.global_step, saved_already(state.global_step))
                    if self.notices.stop_saved(state.global_step, save_s=self._save_s):
                        self.stopped_at = self._reason = None  # the notice window: train on
                        return True
                else:
                    logger.warning(
                        "stopping after step %d for a notice: writing the emergency checkpoint", state.global_step
                    )
            control.should_training_stop = True
            return True
        if verdict == ADVISORY:
            self._reason = "advisory"
            control.should_save = state.global_step != self._committed_step  # never rewrite committed files
            return True
        return False

    def _commit(
        self, step: int, folder: Path, reason: str, began: float | None = None, may_train_on: bool = True
    ) -> bool:
        """Commit the Trainer's folder; collective in a process group (a rank without it stores nothing).
        ``began``: when the Trainer was asked to write it. True: an emergency one opened the notice window."""
        emergency = reason == "emergency"
        try:
            self._commit_folder(step, folder, reason, began, self.notices.deadline() if emergency else None)
        except Exception as e:  # a failed periodic commit must not end the training
            tail = "; the resume point stays the previous checkpoint" if emergency else ""
            logger.error("%s checkpoint of step %d NOT committed (%s: %s)%s", reason, step, type(e).__name__, e, tail)
            return emergency and self.notices.stop_saved(step, e, may_train_on=may_train_on)
        if not emergency or not self.notices.stop_saved(step, save_s=self._save_s, may_train_on=may_train_on):
            return False
        self.stopped_at = None  # the notice window: train on, checkpoint again before the deadline
        return True

    def _commit_folder(
        self, step: int, folder: Path, reason: str, began: float | None, deadline: float | None, supersede: bool = False
    ) -> None:
        """Commit the Trainer's folder of ``step`` before ``deadline``, or raise."""
        with self.notices.marks.during(SAVING, step, last=True):  # begun with the Trainer's write (cb.train)
            if self.checkpoints.group.get() is None and not folder.is_dir():
                raise FileNotFoundError(f"the Trainer's checkpoint folder {folder} is missing")
            t0 = time.monotonic() if began is None else began
            self.checkpoints.commit(step, folder, reason, deadline, supersede=supersede)
        self._committed_step = step
        self._save_s = time.monotonic() - t0

    def _save_interrupted(self, trainer: Any) -> None:
        """After a notice cut training short outside a step: checkpoint unless the state is already saved."""
        step = self.stopped_at = trainer.state.global_step
        self.notices.emergency(
            step,
            step in (self._resumed_step, self._committed_step),
            lambda deadline: self._save_cut(trainer, step, deadline),
            None,  # the Trainer has left its loop: no notice window
            self._committed_step,
            where="during an evaluation after step",
            may_train_on=False,
        )

    def _save_cut(self, trainer: Any, step: int, deadline: float | None) -> None:
        """The Trainer's own checkpoint of ``step``, left inside an evaluation, committed; or raise."""
        folder = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        if self._rng_before_eval is not None:  # the streams the cut evaluation started with: it is run again
            state_module.restore_rng(self._rng_before_eval)
        # The Trainer's own save (its private method: the public save_model() writes no optimizer/RNG state).
        began = time.monotonic()
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        if self._rng_before_eval is not None and is_node_leader():  # its node's folder: one writer
            replace_text(folder / EVAL_CUT, json.dumps({"step": step}))
        self._commit_folder(step, folder, "emergency", began, deadline)

    def _save_final(self, trainer: Any) -> None:
        """Resumed from an evaluation cut at the last step, and that evaluation run again: the stored checkpoint
        holds the streams it began with, the uninterrupted run's last save (``save_strategy="steps"``) those it
        left. Commit the latter in its place, as the step's next revision."""
        step, output_dir = trainer.state.global_step, Path(trainer.args.output_dir)
        folder = output_dir / f"checkpoint-{step}"
        if is_node_leader():  # the cut run's folder, kept on this disk: its committed files (links) and its marker
            if self.checkpoints.storage.links_files:
                unlink_linked_ahead(output_dir, step - 1)
            (folder / EVAL_CUT).unlink(missing_ok=True)
        trainer.accelerator.wait_for_everyone()  # before any rank writes its own files there
        trainer.control.should_save = trainer.control.should_training_stop = True  # saved too: as at the Trainer's end
        began = time.monotonic()
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        self._commit_folder(step, folder, "final", began, None, supersede=True)
