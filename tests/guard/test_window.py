"""``deadline_policy="use-window"`` in one process: the emergency checkpoint at once, training on in the
notice window, a second checkpoint before the deadline; and every way it falls back to "stop"."""

from __future__ import annotations

import datetime as dt
import logging
import math
import time

import pytest
import torch

import spotguard
from spotguard import Notice, checkpoint
from spotguard.errors import ConfigError, StorageError
from spotguard.guard.window import DeadlinePolicy, Window, reserve
from spotguard.notices.azure import AzureProvider
from spotguard.storage import LocalStorage, open_storage

STEP_S = 0.05


def steps_in(root) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def notice_in(seconds: float | None, kind: str = "preempt") -> Notice:
    deadline = None if seconds is None else dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds)
    return Notice("test", kind, deadline=deadline, raw={"kind": kind, "in": seconds})


def train(guard: spotguard.Guard, notice_at: int, notice: Notice | None, steps: int = 2000, on_step=None):
    """Steps of STEP_S until ``guard.step`` says stop; (step it stopped at or None, [(step, monotonic)])."""
    seen: list[tuple[int, float]] = []
    with guard:
        for step in range(1, steps):
            if step == notice_at and notice is not None:
                guard.watcher.report(notice)
            time.sleep(STEP_S)
            stop = guard.step(step)
            seen.append((step, time.monotonic()))
            if on_step is not None:
                on_step(step)
            if stop:
                return step, seen
    return None, seen


def window_guard(root, storage=None, **kw) -> spotguard.Guard:
    options = {"providers": [], "deadline_policy": "use-window", "window_margin": 1.0, "keep": 10, **kw}
    return spotguard.Guard(storage or str(root), **options).track(model=torch.nn.Linear(4, 4))


def test_a_window_opens_only_with_a_measured_save_and_time_beyond_the_reserve():
    assert reserve(2.0, 5.0) == pytest.approx(2.5 + 5.0)
    now = time.monotonic()
    assert Window.open(10, now + 30, math.inf, 5.0, 30.0) is None  # no save measured
    assert Window.open(10, now + 7, 2.0, 5.0, 7.0) is None  # 7 s left, 7.5 s needed
    w = Window.open(10, now + 30, 2.0, 5.0, 30.0)
    assert w is not None and w.reserve_s == pytest.approx(7.5)
    # steps of 1 s: the last one that leaves one more step and the reserve before the deadline is at 21 s
    w.last = now
    assert next(k for k in range(1, 40) if w.closing(now + k)) == 22  # 22 + 1 + 7.5 >= 30
    w.cut(None)  # another stop notice without a deadline: now
    assert w.deadline <= time.monotonic() and w.closing()


def test_use_window_commits_at_once_trains_on_and_commits_again_before_the_deadline(tmp_path):
    events: list[dict] = []
    guard = window_guard(tmp_path)
    guard.events.add(lambda rec: events.append(rec))
    notice = notice_in(5.0)
    deadline = time.monotonic() + notice.seconds_left()
    first_committed: list[int] = []

    def on_step(step):
        if not first_committed and steps_in(tmp_path):
            first_committed.append(step)

    stopped, seen = train(guard, 5, notice, on_step=on_step)
    assert first_committed == [5]  # committed by the stop step's guard.step(), as "stop" would
    assert stopped is not None and stopped > 5 + 10, seen[-1]  # ~4 s of window at 0.05 s a step
    assert steps_in(tmp_path) == [(5, "emergency"), (stopped, "emergency")]
    kinds = [e["event"] for e in events if e["event"] in ("window", "stop")]
    assert kinds == ["window", "stop"]
    win, stop = (next(e for e in events if e["event"] == k) for k in ("window", "stop"))
    assert win["step"] == 5 and win["committed"] and win["reserve_s"] == pytest.approx(reserve(win["save_s"], 1.0))
    assert stop["step"] == stopped and stop["committed"] and stop["lost_steps"] == 0 and stop["first_step"] == 5
    # the second stop came after the last step that left one more step and the reserve (its save included)
    ended = dict(seen)[stopped]
    longest = max(b - a for (_, a), (_, b) in zip(seen, seen[1:], strict=False))
    latest = deadline - win["reserve_s"] + win["save_s"] + 0.2
    assert deadline - win["reserve_s"] - longest - 0.5 <= ended <= latest, (deadline, ended, longest, win)
    assert time.monotonic() < deadline  # committed in time
    again = window_guard(tmp_path)
    assert again.resume() == stopped


def test_use_window_without_a_deadline_is_stop(tmp_path):
    guard = window_guard(tmp_path)
    stopped, _ = train(guard, 3, notice_in(None, "signal"))
    assert stopped == 3 and steps_in(tmp_path) == [(3, "emergency")]
    assert guard.window is None and guard.stopped_at == 3


def test_use_window_with_too_little_time_left_is_stop(tmp_path, caplog):
    guard = window_guard(tmp_path, window_margin=5.0)
    with caplog.at_level(logging.WARNING):
        stopped, _ = train(guard, 3, notice_in(4.0))
    assert stopped == 3 and steps_in(tmp_path) == [(3, "emergency")]
    assert "notice window not used" in caplog.text


def test_another_stop_notice_in_the_window_brings_the_second_checkpoint_forward(tmp_path):
    guard = window_guard(tmp_path)

    def sigterm_later(step):
        if step == 8:  # the window is open: a SIGTERM as the machine shuts down, no deadline
            assert guard.window is not None
            guard.watcher.report(notice_in(None, "signal"))

    stopped, _ = train(guard, 3, notice_in(60.0), on_step=sigterm_later)
    assert stopped == 9 and steps_in(tmp_path) == [(3, "emergency"), (9, "emergency")]


class FailingAfter(LocalStorage):
    """A disk that fails every write once ``broken`` is set (the second checkpoint's)."""

    broken = False

    def put_file(self, key, path, *, deadline=None):
        if self.broken:
            raise StorageError(f"disk gone while writing {key}")
        return super().put_file(key, path, deadline=deadline)

    def open_write(self, key, *, deadline=None):
        if self.broken:
            raise StorageError(f"disk gone while writing {key}")
        return super().open_write(key, deadline=deadline)


def test_a_second_checkpoint_that_fails_leaves_the_first_as_the_resume_point(tmp_path, caplog):
    storage = FailingAfter(str(tmp_path))
    guard = window_guard(tmp_path, storage=storage)

    def break_disk(step):
        if step == 6:
            storage.broken = True

    with caplog.at_level(logging.ERROR):
        stopped, _ = train(guard, 3, notice_in(4.0), on_step=break_disk)
    assert stopped is not None and stopped > 6
    assert "NOT committed" in caplog.text and guard.emergency_error is not None
    assert steps_in(tmp_path) == [(3, "emergency")]
    assert window_guard(tmp_path).resume() == 3


def test_azure_events_are_approved_only_after_the_second_checkpoint(mock_metadata, tmp_path):
    """Approving the event lets Azure evict at once: not while the window is being used."""
    server = mock_metadata("azure")
    guard = window_guard(tmp_path, providers=[AzureProvider(server.url)], interval=0.05)
    acks_while_training: list[int] = []

    def on_step(step):
        if step == 2:
            server.mock.trigger("preempt", warning=5)
        if guard.window is not None:
            acks_while_training.append(len(server.mock.acks))

    stopped, _ = train(guard, 0, None, on_step=on_step)
    assert stopped is not None and len(steps_in(tmp_path)) == 2
    assert acks_while_training and set(acks_while_training) == {0}
    assert server.mock.acks == [guard.notice.raw["EventId"]]


def test_the_policy_comes_from_the_option_or_the_environment(tmp_path, monkeypatch):
    assert spotguard.Guard(str(tmp_path), providers=[]).options.deadline_policy is DeadlinePolicy.STOP
    monkeypatch.setenv("SPOTGUARD_DEADLINE_POLICY", "use-window")
    assert spotguard.Guard(str(tmp_path), providers=[]).options.deadline_policy is DeadlinePolicy.USE_WINDOW
    given = spotguard.Guard(str(tmp_path), providers=[], deadline_policy="stop")
    assert given.options.deadline_policy is DeadlinePolicy.STOP
    monkeypatch.setenv("SPOTGUARD_DEADLINE_POLICY", "later")
    with pytest.raises(ConfigError, match=r"\$SPOTGUARD_DEADLINE_POLICY: must be one of \['stop', 'use-window'\]"):
        spotguard.Guard(str(tmp_path), providers=[])
    monkeypatch.delenv("SPOTGUARD_DEADLINE_POLICY")
    with pytest.raises(ConfigError, match="deadline_policy must be one of"):
        spotguard.Guard(str(tmp_path), providers=[], deadline_policy="window")
    with pytest.raises(ConfigError, match="window_margin"):
        spotguard.Guard(str(tmp_path), providers=[], window_margin=-1)
