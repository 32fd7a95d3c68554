"""``deadline_policy="use-window"`` in the trainer integrations: each one's own hook, driven in process
(LoopGuard for Accelerate and DeepSpeed, the HF and Lightning callbacks), commits the emergency
checkpoint, trains on, and commits a second one before the deadline, through the one ``WindowPolicy``
the Guard uses; and ranks that disagree on the policy are refused alike (two real gloo processes)."""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from spotguard import EXIT_PREEMPTED, checkpoint, heartbeat
from spotguard.errors import StorageError
from spotguard.integrations._loop import LoopGuard
from spotguard.notices.azure import AzureProvider
from spotguard.notices.base import Notice
from spotguard.storage import open_storage

from ..helpers import WORKERS, run_ranks, worker_results
from .test_common import trainer_folder

STEP_S = 0.05
WINDOW = {"deadline_policy": "use-window", "window_margin": 0.3}


def steps_in(root) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def notice_in(seconds: float | None, kind: str = "preempt") -> Notice:
    deadline = None if seconds is None else dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)
    return Notice("test", kind, deadline=deadline, raw={"kind": kind, "in": seconds})


class FolderLoop(LoopGuard):
    """A hand-written loop's guard (as Accelerate's and DeepSpeed's) whose state is a small folder."""

    def __init__(self, storage: str, **options) -> None:
        super().__init__(storage, {"providers": [], "save_on_exit": False, **options})
        self.broken = False

    def save(self, step, reason="manual", *, deadline=None):
        if self.broken:
            raise StorageError(f"disk gone while writing step {step}")
        with self.checkpoints.storage.scratch() as scratch:
            manifest = self.checkpoints.commit(step, trainer_folder(scratch, step), reason, deadline)
        self._saved(step)
        return manifest

    def resume(self):
        return 0


def train_loop(guard: FolderLoop, notice: Notice | None, notice_at: int = 3, on_step=None) -> int | None:
    with guard:
        for step in range(1, 400):
            if step == notice_at and notice is not None:
                guard.notices.watcher.report(notice)
            time.sleep(STEP_S)
            if guard.step(step):
                return step
            if on_step is not None:
                on_step(step)
    return None


def test_a_loop_guard_commits_at_once_trains_on_and_commits_again_before_the_deadline(tmp_path):
    guard = FolderLoop(str(tmp_path), **WINDOW)
    notice = notice_in(2.5)
    deadline = time.monotonic() + notice.seconds_left()
    in_window: list[int] = []

    def on_step(step):
        if guard.notices.in_window:
            in_window.append(step)
            assert steps_in(tmp_path)[0] == (3, "emergency") and guard.stopped_at is None

    stopped = train_loop(guard, notice, on_step=on_step)
    assert in_window[0] == 3 and stopped is not None and stopped > 3 + 5, (in_window, stopped)
    assert steps_in(tmp_path) == [(3, "emergency"), (stopped, "emergency")]
    assert time.monotonic() < deadline and guard.stopped_at == stopped and guard.exit_code == EXIT_PREEMPTED
    assert guard.emergency_error is None and guard.window_error is None


def test_a_loop_guard_whose_second_checkpoint_fails_keeps_the_first_and_still_exits_75(tmp_path):
    guard = FolderLoop(str(tmp_path), **WINDOW)

    def break_disk(step):
        if step == 5:
            guard.broken = True

    stopped = train_loop(guard, notice_in(2.5), on_step=break_disk)
    assert stopped is not None and stopped > 5 and steps_in(tmp_path) == [(3, "emergency")]
    assert guard.emergency_error is None and isinstance(guard.window_error, StorageError)
    assert guard.exit_code == EXIT_PREEMPTED and guard.notices._beat.flags & heartbeat.COMMITTED


def test_a_loop_guard_stops_at_once_without_a_deadline_or_with_the_default_policy(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOTGUARD_DEADLINE_POLICY", raising=False)
    assert train_loop(FolderLoop(str(tmp_path / "a"), **WINDOW), notice_in(None, "signal")) == 3
    assert train_loop(FolderLoop(str(tmp_path / "b")), notice_in(30.0)) == 3
    assert steps_in(tmp_path / "a") == steps_in(tmp_path / "b") == [(3, "emergency")]


def test_another_stop_notice_in_the_window_brings_the_second_checkpoint_forward(tmp_path):
    guard = FolderLoop(str(tmp_path), **WINDOW)

    def sigterm_later(step):
        if step == 8:  # the window is open: a SIGTERM as the machine shuts down, no deadline
            assert guard.notices.in_window
            guard.notices.watcher.report(notice_in(None, "signal"))

    assert train_loop(guard, notice_in(60.0), on_step=sigterm_later) == 9
    assert steps_in(tmp_path) == [(3, "emergency"), (9, "emergency")]


def test_azure_events_are_approved_only_after_the_second_checkpoint(mock_metadata, tmp_path):
    server = mock_metadata("azure")
    guard = FolderLoop(str(tmp_path), **{**WINDOW, "providers": [AzureProvider(server.url)], "interval": 0.05})
    acks_in_window: list[int] = []

    def on_step(step):
        if step == 2:
            server.mock.trigger("preempt", warning=3)
        if guard.notices.in_window:
            acks_in_window.append(len(server.mock.acks))

    stopped = train_loop(guard, None, on_step=on_step)
    assert stopped is not None and len(steps_in(tmp_path)) == 2
    assert acks_in_window and set(acks_in_window) == {0}
    assert server.mock.acks == [guard.notice.raw["EventId"]]


def test_the_hf_callback_trains_on_in_the_window_without_periodic_saves(tmp_path, monkeypatch):
    """The Trainer's own flow, hook by hook: on_step_end, then (when asked) its save and on_save."""
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState

    from spotguard.integrations.hf import SpotguardCallback

    monkeypatch.setenv("SPOTGUARD_DEADLINE_POLICY", "use-window")  # the policy from the environment
    cb = SpotguardCallback(str(tmp_path / "ckpt"), providers=[], window_margin=0.3)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path / "out")), TrainerState(), TrainerControl()
    stopped, went_on = None, []
    for step in range(1, 400):
        if step == 3:
            cb.notices.watcher.report(notice_in(2.5))
        time.sleep(STEP_S)
        state.global_step = step
        control.should_save = step % 5 == 0  # HF's save_steps=5, as its DefaultFlowCallback asks first
        control = cb.on_step_end(args, state, control)
        if control.should_save:
            trainer_folder(Path(args.output_dir), step)  # the Trainer's _save_checkpoint
            control.should_save = False
            cb.on_save(args, state, control)
        if control.should_training_stop:
            stopped = step
            break
        if step >= 3:
            went_on.append(step)
    cb.close()
    assert went_on and went_on[0] == 3 and stopped is not None and stopped > 3 + 5
    assert steps_in(tmp_path / "ckpt") == [(3, "emergency"), (stopped, "emergency")]  # no periodic in the window
    assert cb.stopped_at == stopped and cb.exit_code == EXIT_PREEMPTED


def test_the_lightning_callback_trains_on_in_the_window(tmp_path):
    pytest.importorskip("lightning")
    from spotguard.integrations.lightning import SpotguardCallback

    class Trainer(SimpleNamespace):
        def save_checkpoint(self, path, weights_only=False):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(bytes([self.global_step]) * 64)

    cb = SpotguardCallback(str(tmp_path / "ckpt"), every_steps=5, providers=[], **WINDOW)
    trainer = Trainer(global_step=0, should_stop=False, global_rank=0, sanity_checking=False)
    stopped, went_on = None, []
    for step in range(1, 400):
        if step == 3:
            cb.notices.watcher.report(notice_in(2.5))
        time.sleep(STEP_S)
        cb.on_before_optimizer_step(trainer, None, None)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, None, None, None, step - 1)
        if trainer.should_stop:
            stopped = step
            break
        if step >= 3:
            went_on.append(step)
    cb.close()
    assert went_on and went_on[0] == 3 and stopped is not None and stopped > 3 + 5
    assert steps_in(tmp_path / "ckpt") == [(3, "emergency"), (stopped, "emergency")]
    assert cb.stopped_at == stopped and cb.exit_code == EXIT_PREEMPTED


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_deadline_policy_all_raise_a_config_error(tmp_path):
    cmd = [sys.executable, str(WORKERS / "dist_policy_mismatch.py"), str(tmp_path / "ckpt"), str(tmp_path)]
    for r, done in enumerate(run_ranks(cmd, timeout=100)):
        assert done.returncode == 0, f"rank {r}: {done.stderr[-3000:]}"
    results = {(rec["rank"], rec["case"]): rec for rec in worker_results(tmp_path)}
    for rank in (0, 1):
        for case in ("guard", "integration"):
            rec = results[(rank, case)]
            assert rec["raised"], (rank, case)
            assert "deadline_policy differs between ranks ('stop' on some, 'use-window' on others" in rec["message"]
