"""The training loop's face: track the state, resume it, and checkpoint at the right steps.

Order of use: ``Guard(...)`` -> ``track(...)`` -> ``resume()`` -> ``with guard:`` (starts the
watcher) -> ``guard.step(n)`` after every completed step -> leaving the block stops the watcher
and writes a final checkpoint. ``step()`` is the hot path: when nothing is due it does one flag
check and one or two comparisons.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import checkpoint, data, state
from .checkpoint import CheckpointInfo, Manifest
from .errors import CheckpointCorruptError, CheckpointExistsError, ConfigError, SpotguardError
from .notices.base import Notice, NoticeProvider
from .storage import Storage, open_storage
from .watcher import Watcher

logger = logging.getLogger(__name__)

#: Exit code of a job that stopped for a notice (EX_TEMPFAIL): "stopped on purpose, resume elsewhere".
EXIT_PREEMPTED = 75
STORAGE_ENV = "SPOTGUARD_STORAGE"
STATE_FILE = "state.pt"


@dataclass
class GuardOptions:
    """When to checkpoint and what to watch. Validated on creation."""

    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3
    providers: str | Iterable[str | NoticeProvider] | None = "auto"
    interval: float = 1.0
    save_on_exit: bool = True
    stop_on_advisory: bool = False
    checkpoint_on_advisory: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ConfigError(f"every_steps must be a positive int or None, got {self.every_steps!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ConfigError(f"every_seconds must be positive or None, got {self.every_seconds!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep must be an int >= 1, got {self.keep!r}")
        if not self.interval > 0:
            raise ConfigError(f"interval must be positive, got {self.interval!r}")


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Guard:
    """Checkpoints a training loop periodically and on a notice, and resumes it exactly.

    ``storage`` is a path, ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix`` URL (or a
    ``Storage``); when None it is read from ``$SPOTGUARD_STORAGE``.
    """

    def __init__(
        self,
        storage: str | Storage | None = None,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int = 3,
        providers: str | Iterable[str | NoticeProvider] | None = "auto",
        interval: float = 1.0,
        save_on_exit: bool = True,
        stop_on_advisory: bool = False,
        checkpoint_on_advisory: bool = True,
    ) -> None:
        self.options = GuardOptions(every_steps, every_seconds, keep, providers, interval, save_on_exit,
                                    stop_on_advisory, checkpoint_on_advisory)
        if storage is None:
            storage = os.environ.get(STORAGE_ENV)
            if not storage:
                raise ConfigError(f"no storage given: pass a URL or set ${STORAGE_ENV}")
        self.storage: Storage = open_storage(storage)
        self.watcher = Watcher(providers, interval, on_notice=self._on_notice, stop_on_advisory=stop_on_advisory)
        self.preempted = self.watcher.preempted
        #: JSON-serialisable values saved in the manifest and restored by ``resume()``.
        self.extra: dict[str, Any] = {}
        self.stopped_at: int | None = None
        self.last_saved: Manifest | None = None
        self.emergency_error: BaseException | None = None
        self._objects: dict[str, Any] = {}
        self._step: int | None = None
        self._saved_step: int | None = None
        self._due_step: float = math.inf
        self._due_time: float = math.inf
        self._timed = every_seconds is not None
        self._schedule(0)

    # -- setup -------------------------------------------------------------------------------
    @property
    def notice(self) -> Notice | None:
        """The notice that caused the stop, or None."""
        return self.watcher.notice

    def track(self, **objects: Any) -> Guard:
        """Register objects with ``state_dict()``/``load_state_dict()`` under stable names."""
        for name, obj in objects.items():
            if data.warn_if_plain_loader(name, obj):
                continue
            state.check_trackable(name, obj)
            self._objects[name] = obj
        return self

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint in storage (manifest checked, contents not), or None."""
        return checkpoint.latest(self.storage)

    def resume(self) -> int:
        """Restore the newest checkpoint that verifies; return its step (0 when there is none).

        A checkpoint that fails verification is skipped with a warning naming the reason, and the
        previous one is tried. A valid checkpoint that does not fit the tracked objects raises.
        """
        infos = checkpoint.scan(self.storage)
        for info in reversed(infos):
            if not info.complete:
                logger.warning("skipping %s: %s (%s)", self.storage.describe(info.name), info.status, info.problem)
                continue
            try:
                payload = self._load(info)
            except CheckpointCorruptError as e:
                logger.warning("skipping %s: %s", self.storage.describe(info.name), e)
                continue
            self._restore(info, payload)
            logger.info("resumed from %s (step %d, %s)", self.storage.describe(info.name), info.step,
                        info.manifest.reason if info.manifest else "?")
            return info.step
        logger.info("no checkpoint in %s: starting from step 0", self.storage.describe())
        return 0

    def _load(self, info: CheckpointInfo) -> dict[str, Any]:
        with checkpoint.open_verified(self.storage, info, STATE_FILE) as path:
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # weights_only refuses anything but tensors and plain containers
                raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: cannot be loaded safely ({e})") from e
        if not isinstance(payload, dict) or payload.get("step") != info.step or "objects" not in payload:
            raise CheckpointCorruptError(f"{info.name}/{STATE_FILE}: unexpected content")
        return payload

    def _restore(self, info: CheckpointInfo, payload: dict[str, Any]) -> None:
        state.restore(self._objects, payload["objects"], where=info.name)
        generators = payload.get("generators", {})
        for name, obj in self._objects.items():
            if data.is_stateful_loader(obj):
                data.restore_generator(obj, generators.get(name))
                data.neutralize_next_iterator(obj)
        self.extra.clear()
        self.extra.update(info.manifest.extra if info.manifest else {})
        state.restore_rng(payload["rng"])  # last: nothing after this may draw
        self._step = self._saved_step = info.step
        self.last_saved = info.manifest
        self._schedule(info.step)

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> bool:
        """Call after each completed step. Saves when due; True means stop (checkpoint committed)."""
        if self.preempted.is_set() or step >= self._due_step or (self._timed and time.monotonic() >= self._due_time):
            return self._step_slow(step)
        self._step = step
        return False

    def _step_slow(self, step: int) -> bool:
        self._step = step
        if self.preempted.is_set():
            if self.stopped_at is None:
                self.stopped_at = step
                self._emergency(step)
            return True
        self._save_logged(step, "advisory" if self._due_step == -math.inf else "periodic")
        return False

    def _emergency(self, step: int) -> None:
        notice = self.notice
        left = notice.seconds_left() if notice else None
        budget = "" if left is None else f", {left:.1f}s before the deadline"
        if self._saved_step == step:
            logger.warning("stop at step %d: already checkpointed%s", step, budget)
            if notice:
                self.watcher.acknowledge(notice)
            return
        t0 = time.monotonic()
        deadline = None if left is None else t0 + left
        try:
            self.save(step, "emergency", deadline=deadline)
        except Exception as e:
            self.emergency_error = e
            lost = step - self._saved_step if self._saved_step is not None else step
            logger.error("emergency checkpoint of step %d FAILED (%s: %s); resume point stays %s, %d step(s) lost",
                         step, type(e).__name__, e,
                         f"step {self._saved_step}" if self._saved_step is not None else "the start", lost)
            return
        took = time.monotonic() - t0
        tail = "" if left is None else f", {left - took:.1f}s before the deadline"
        logger.warning("emergency checkpoint of step %d committed in %.2fs%s", step, took, tail)
        if notice:
            self.watcher.acknowledge(notice)  # e.g. Azure: approve the eviction, our state is safe

    def _save_logged(self, step: int, reason: str) -> None:
        try:
            self.save(step, reason)
        except SpotguardError as e:
            logger.error("%s checkpoint of step %d failed: %s; training goes on", reason, step, e)
            self._schedule(step)
        except OSError as e:
            logger.error("%s checkpoint of step %d failed: %s; training goes on", reason, step, e)
            self._schedule(step)

    def save(self, step: int, reason: str = "manual", *, deadline: float | None = None) -> Manifest | None:
        """Write a checkpoint of the current state as ``step`` now (synchronously).

        Returns None when ``step`` is already committed. The global RNG streams are left exactly as
        they were, whatever the storage libraries draw while writing.
        """
        if self._saved_step == step:
            return None
        with state.rng_isolated():
            payload = {
                "step": step,
                "rng": state.capture_rng(),  # first: collecting a loader's state may draw
                "objects": state.collect(self._objects),
                "generators": {n: g for n, o in self._objects.items()
                               if (g := data.generator_state(o)) is not None},
            }
            try:
                manifest = checkpoint.write(
                    self.storage, step, {STATE_FILE: lambda f: torch.save(payload, f)}, reason=reason,
                    extra=self.extra, world_size=_world_size(), torch_version=torch.__version__,
                    deadline=deadline)
            except CheckpointExistsError:
                logger.info("%s is already committed; not writing it twice", self.storage.describe(checkpoint.step_dir(step)))
                manifest = None
        self._saved_step = step
        if manifest is not None:
            self.last_saved = manifest
            logger.info("%s checkpoint of step %d written (%.1f MB)", reason, step, manifest.size / 1e6)
            try:
                checkpoint.prune(self.storage, self.options.keep)
            except Exception as e:
                logger.warning("pruning old checkpoints failed: %s", e)
        self._schedule(step)
        return manifest

    def _schedule(self, step: int) -> None:
        every = self.options.every_steps
        self._due_step = step + every if every else math.inf
        if self.options.every_seconds is not None:
            self._due_time = time.monotonic() + self.options.every_seconds

    def _on_notice(self, notice: Notice) -> None:
        if notice.advisory and not self.options.stop_on_advisory and self.options.checkpoint_on_advisory:
            self._due_step = -math.inf  # the next step() checkpoints early (from the loop's thread)

    # -- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> Guard:
        self.watcher.start()
        if self._timed:
            self._due_time = time.monotonic() + (self.options.every_seconds or 0)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close(save=exc_type is None)

    def close(self, save: bool = True) -> None:
        """Stop the watcher and, after a clean finish, checkpoint the last completed step."""
        self.watcher.stop()
        if save and self.options.save_on_exit and self.stopped_at is None and self._step is not None \
                and self._step != self._saved_step:
            self._save_logged(self._step, "final")
