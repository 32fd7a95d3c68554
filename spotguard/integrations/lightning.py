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

Lightning does not save the global RNG streams; this callback's own state does (in the ``.ckpt``),
and restores them where an uninterrupted run would have had them, so dropout continues exactly.
Data positions are Lightning's: use torchdata's ``StatefulDataLoader`` for mid-epoch resumes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint import state
from spotguard.heartbeat import EXIT_PREEMPTED

from ..errors import MissingDependencyError
from ..storage import Storage
from ._common import WatchOptions, refuse_process_group, watch_parts

if TYPE_CHECKING:
    from typing_extensions import Unpack

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


class _Interrupt(Exception):
    """Raised from a hook to leave ``trainer.fit`` where Lightning offers no way out (validation, warm-up)."""


class SpotguardCallback(Callback):
    """Stops a Lightning ``Trainer`` after the current step on a notice, commits its checkpoint, resumes verified ones.

    ``storage``: a path or ``s3://``/``gs://`` URL (default ``$SPOTGUARD_STORAGE``); ``keep``
    checkpoints are kept there. ``every_steps``: periodic checkpoints through the same path (None:
    only on notices). ``providers``/``interval``/``stop_on_advisory``: as for ``spotguard.Guard``.
    """

    def __init__(
        self, storage: str | Storage | None = None, *, every_steps: int | None = None, **options: Unpack[WatchOptions]
    ) -> None:
        self.checkpoints, self.notices = watch_parts(storage, options)
        self.every_steps = every_steps
        #: The step this run stopped at for a notice (its checkpoint committed when ``emergency_error`` is None).
        self.stopped_at: int | None = None
        self.emergency_error: BaseException | None = None
        self._watch = self.notices
        self._trainer: Any = None
        self._resumed_step = 0
        self._steps = self._seen_steps = 0  # optimizer steps (as trainer.global_step), and the last one acted on
        self._committed_step: int | None = None
        self._rng_before_validation: dict[str, Any] | None = None
        self._rng_after_iterator: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "spotguard"

    # -- the user's side ---------------------------------------------------------------------
    def resume_from_checkpoint(self) -> str | None:
        """The newest checkpoint that verifies, as a local ``.ckpt`` path for ``trainer.fit(ckpt_path=...)``."""
        found = self.checkpoints.newest_verified()
        return str(found[1] / CKPT_NAME) if found else None

    def fit(self, trainer: Any, model: Any, **kwargs: Any) -> int:
        """``trainer.fit`` from the newest verified checkpoint; returns the job's exit code (75 after a notice)."""
        if self not in trainer.callbacks:
            trainer.callbacks.append(self)
        kwargs.setdefault("weights_only", True)  # torch.load's safe mode: the checkpoint holds no code
        try:
            trainer.fit(model, ckpt_path=self.resume_from_checkpoint(), **kwargs)
        except (_Interrupt, SIGTERMException):
            if self.stopped_at is None:
                raise
        finally:
            self.close()
        return self.exit_code

    @property
    def exit_code(self) -> int:
        """``spotguard.EXIT_PREEMPTED`` (75) after a stop notice (or Lightning's own SIGTERM stop), else 0."""
        return EXIT_PREEMPTED if self.stopped_at is not None or self.notices.preempted.is_set() else 0

    def close(self) -> None:
        self.notices.stop()
        self.checkpoints.cleanup()

    # -- checkpoint state: the RNG streams Lightning leaves out ------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Saved mid-validation, the resumed run repeats the validation: give it the streams it started with.
        return {"rng": self._rng_before_validation or state.capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Set now, and again once the resumed loader's first iterator exists (on_train_start): the
        # uninterrupted run created no iterator at this point, so creating one must leave no trace.
        state.restore_rng(state_dict["rng"])
        self._rng_after_iterator = state_dict["rng"]

    # -- Lightning events --------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            refuse_process_group("the Lightning SpotguardCallback")
            self._trainer = trainer
            self.notices.start()  # before Lightning's own SIGTERM handler, which then calls ours too

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._resumed_step = self._steps = self._seen_steps = trainer.global_step
        if self._rng_after_iterator is not None:
            state.restore_rng(self._rng_after_iterator)
            self._rng_after_iterator = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._watch.due and self.notices.preempted.is_set() and trainer.global_step == self._resumed_step:
            raise _Interrupt  # a notice before the first step: the state is the resume point, stop now

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._steps += 1  # our own count: trainer.global_step is a chain of properties, too slow per batch

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._steps == self._seen_steps:
            return  # accumulating gradients: no optimizer step yet, nothing to stop or save at
        self._seen_steps = self._steps
        if self._watch.due:
            self._due(trainer)
        elif self.every_steps and self._steps % self.every_steps == 0 and trainer.global_step != self._committed_step:
            self._save(trainer, "periodic")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._rng_before_validation = state.capture_rng()

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._watch.due and self.notices.preempted.is_set() and not trainer.sanity_checking:
            raise _Interrupt  # cut the validation short: the checkpoint must make the deadline

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._rng_before_validation = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not isinstance(exception, (_Interrupt, SIGTERMException)):
            return
        if self.stopped_at is None:
            self.stopped_at = trainer.global_step
            if trainer.global_step in (self._resumed_step, self._committed_step):
                logger.warning("stopped for a notice at step %d: it is already checkpointed", trainer.global_step)
                return
            where = "during validation" if self._rng_before_validation is not None else "outside a training step"
            logger.warning(
                "stopped for a notice %s after step %d: writing the emergency checkpoint", where, trainer.global_step
            )
            self._save(trainer, "emergency")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._trainer = None
            self.close()

    # -- inside ------------------------------------------------------------------------------
    def _due(self, trainer: Any) -> None:
        if self.notices.preempted.is_set():
            trainer.should_stop = True
            if self.stopped_at is None:
                self.stopped_at = trainer.global_step
                logger.warning(
                    "stopping after step %d for a notice: writing the emergency checkpoint", trainer.global_step
                )
                if trainer.global_step != self._committed_step:
                    self._save(trainer, "emergency")
        elif self.notices.take_advisory():
            self._save(trainer, "advisory")

    def _save(self, trainer: Any, reason: str) -> None:
        step, emergency = trainer.global_step, reason == "emergency"
        try:
            with self.checkpoints.storage.scratch() as scratch:
                folder = scratch / "lightning"
                t0 = time.monotonic()
                trainer.save_checkpoint(str(Path(folder) / CKPT_NAME), weights_only=False)  # the full state
                logger.debug("save_checkpoint of step %d took %.2fs", step, time.monotonic() - t0)
                self.checkpoints.commit(step, folder, reason, self.notices.deadline() if emergency else None)
            self._committed_step = step
        except Exception as e:  # a failed periodic save must not end the training
            logger.error("%s checkpoint of step %d NOT committed (%s: %s)", reason, step, type(e).__name__, e)
            if emergency:
                self.emergency_error = e
            return
        if emergency:
            self.notices.acknowledge()
