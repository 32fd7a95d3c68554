"""``deadline_policy="use-window"`` in one process: the emergency checkpoint at once, training on in the
notice window, a second checkpoint before the deadline; and every way it falls back to "stop"."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard import Notice, checkpoint, heartbeat
from spotguard.coordination.window import DeadlinePolicy, Window
from spotguard.errors import ConfigError, StorageError
from spotguard.notices.azure import AzureProvider
from spotguard.planner import window_reserve as reserve
from spotguard.storage import LocalStorage, open_storage
from tests.forked import installed
from tests.helpers import (
    DDP_ARGS,
    EXAMPLE,
    EXAMPLE_ARGS,
    WORKERS,
    after_step,
    assert_same_run,
    ddp_example_cmd,
    example_cmd,
    last_step,
    read_jsonl,
    read_losses,
    run_example,
    stop_when,
    stopped_for_notice,
    subprocess_env,
)
from tests.helpers import _start as start  # a process (or a forked run) to stop by hand: no stop_when moment

STEP_S = 0.05
SLOW_DISK = WORKERS / "window_slow_disk.py"


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with installed(EXAMPLE, SLOW_DISK):  # their runs fork from one server: one Python start, one import torch
        yield


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
    assert "NOT committed" in caplog.text and "resume point stays step 3" in caplog.text
    # the first checkpoint stands: no emergency error, the second's apart, and the job still exits 75
    assert guard.emergency_error is None and isinstance(guard.window_error, StorageError)
    assert guard._beat.flags & heartbeat.COMMITTED and guard._beat.flags & heartbeat.STOPPED_FOR_NOTICE
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


# -- real processes --------------------------------------------------------------------------------
def write_notice(path: Path, seconds: float) -> float:
    """A notice file whose deadline is ``seconds`` from now; returns that deadline (time.time())."""
    deadline = time.time() + seconds
    path.write_text(json.dumps({"kind": "terminate", "deadline": deadline}))
    return deadline


def committed_left(stderr: str, step: int) -> float:
    """The T-minus of ``step``'s emergency checkpoint, from its log line."""
    found = re.search(rf"emergency checkpoint of step {step} committed in [0-9.]+s, T-([0-9.]+)s", stderr)
    assert found, stderr[-3000:]
    return float(found.group(1))


def emergency_steps(root: Path) -> list[int]:
    return [s for s, reason in steps_in(root) if reason == "emergency"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_trains_through_a_12s_window_keeps_every_step_and_resumes_exactly(tmp_path, reference_runs):
    """examples/train.py, a notice with 12 s to go: two checkpoints, the steps between them kept."""
    notice, losses, storage = tmp_path / "notice", tmp_path / "losses.jsonl", tmp_path / "ckpt"
    args = (*EXAMPLE_ARGS, "--losses", str(losses), "--providers", "file", "--interval", "0.2")
    first = stop_when(
        example_cmd(storage, *args, "--step-sleep", "0.25", "--deadline-policy", "use-window"),
        after_step(losses, 8),
        lambda _: write_notice(notice, 12.0),
        env=subprocess_env(SPOTGUARD_NOTICE_FILE=str(notice)),
    )
    assert first.returncode == 75, first.stderr[-3000:]
    opened, stopped = emergency_steps(storage)
    assert 8 <= opened < stopped < 90 and stopped - opened >= 10, (opened, stopped)
    assert last_step(losses) == stopped  # trained on after the first checkpoint, up to the second
    reserve_s = float(re.search(r"starts about ([0-9.]+)s before the deadline", first.stderr).group(1))
    assert 0 < committed_left(first.stderr, stopped) <= reserve_s + 1.5  # near the deadline, still in time
    notice.unlink()
    second = run_example(
        storage, *args, "--final", str(tmp_path / "final.pt"), env=subprocess_env(SPOTGUARD_NOTICE_FILE=str(notice))
    )
    assert second.returncode == 0 and f"resuming at step {stopped} " in second.stdout, second.stdout
    assert_same_run(losses, tmp_path / "final.pt", reference_runs(*EXAMPLE_ARGS))  # 0 steps lost, exact


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_checkpoint_cut_by_the_deadline_leaves_the_first_to_resume(tmp_path):
    """The second save outlasts the deadline (the disk slowed down) and the machine goes: resume at the first."""
    notice, root, out_dir = tmp_path / "notice", tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    progress = out_dir / "results-0.jsonl"
    cmd = [sys.executable, str(SLOW_DISK), str(root), str(out_dir)]
    proc, out, err = start(cmd, subprocess_env(SPOTGUARD_NOTICE_FILE=str(notice)), None)

    def stderr() -> str:
        err.seek(0)
        return err.read().decode(errors="replace")[-3000:]

    try:
        while not any(r.get("step", 0) >= 3 for r in read_jsonl(progress)):
            assert proc.poll() is None, stderr()
            time.sleep(0.02)
        deadline = write_notice(notice, 8.0)
        time.sleep(max(deadline - time.time(), 0.0))
        assert proc.poll() is None, stderr()  # still writing the second checkpoint
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the machine is gone at the deadline
        proc.wait()
        out.close()
        err.close()
    records = read_jsonl(progress)
    opened = next(r["window"] for r in records if "window" in r)
    trained = max(r["step"] for r in records if "step" in r)
    assert trained > opened + 5  # the window was used: those steps are what the second save was for
    started = [i for i in checkpoint.scan(open_storage(str(root))) if i.step > opened]
    assert started and not any(i.complete for i in started)  # the second save began, never committed
    guard = spotguard.Guard(str(root), providers=[], untracked="accept").track(model=torch.nn.Linear(64, 64))
    assert guard.resume() == opened


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_agree_on_both_stops_when_only_rank_1_has_the_notice(tmp_path):
    notice, storage = tmp_path / "notice-{rank}", tmp_path / "ckpt"
    losses = str(tmp_path / "loss-{rank}.jsonl")
    first = stop_when(
        ddp_example_cmd(
            2, storage, *DDP_ARGS, "--losses", losses, "--step-sleep", "0.25", "--deadline-policy", "use-window"
        ),
        after_step(tmp_path / "loss-0.jsonl", 3),
        lambda _: write_notice(Path(str(notice).format(rank=1)), 11.0),
        env=subprocess_env(SPOTGUARD_NOTICE_FILE=str(notice)),
    )
    assert stopped_for_notice(first), first.stderr[-3000:]
    opened, stopped = emergency_steps(storage)
    assert opened < stopped < 40, (opened, stopped)
    assert [read_losses(tmp_path / f"loss-{r}.jsonl")[-1][0] for r in range(2)] == [stopped, stopped]
    for r in range(2):  # rank 0 saw no notice, yet took both stops at rank 1's steps, under its deadline
        for step in (opened, stopped):
            assert re.search(rf"\[rank {r}\].*emergency checkpoint of step {step} committed", first.stderr), r
    infos = [i for i in checkpoint.scan(open_storage(str(storage))) if i.complete and i.step >= opened]
    assert [(i.step, i.manifest.world_size) for i in infos] == [(opened, 2), (stopped, 2)]
    # (the resume from such a checkpoint is exact: test_distributed.py resumes an emergency one)
