"""Asynchronous periodic saves: bounded staging, the busy policy, errors kept, two tiers, emergencies."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch

import spotguard
from spotguard import Notice, checkpoint
from spotguard.checkpoint.folders import layout
from spotguard.checkpoint.state.snapshot import Staging
from spotguard.storage import LocalStorage, open_storage


class GatedStorage(LocalStorage):
    """Local storage whose state-file writes wait for ``gate`` (to hold a save in flight)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def put_file(self, key, path, *, deadline=None):
        self.writing.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super().put_file(key, path, deadline=deadline)


def steps(storage) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(storage)) if i.complete]


def model_guard(storage, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    g = spotguard.Guard(storage, providers=[], **kw).track(model=model)
    return g, model


def test_step_returns_before_the_write_and_snapshot_is_isolated_from_training(tmp_path):
    storage = GatedStorage(str(tmp_path))
    g, model = model_guard(storage, every_steps=1)
    with g:
        with torch.no_grad():
            model.weight.fill_(1.0)
        assert g.step(1) is False  # returns although the write is blocked
        assert storage.writing.wait(5) and steps(storage) == []
        with torch.no_grad():
            model.weight.fill_(2.0)  # training moves on while step 1 is written
        storage.gate.set()
        g.wait()
        assert steps(storage) == [(1, "periodic")]
        payload = torch.load(tmp_path / "step-00000001" / "state.pt", weights_only=True)
        assert torch.all(payload["objects"]["model"]["weight"] == 1.0)
    # Leaving the block saves the state as it is now: it changed after step(1), so it replaces step 1.
    assert steps(storage) == [(1, "final")]
    fresh, fresh_model = model_guard(str(tmp_path))
    assert fresh.resume() == 1 and torch.all(fresh_model.weight == 2.0)


class NiceProbeStorage(LocalStorage):
    """Records the niceness of the thread that stores each file."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.nice: list[int] = []

    def put_file(self, key, path, *, deadline=None):
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().put_file(key, path, deadline=deadline)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux-only")
@pytest.mark.parametrize("nice", [7, None])
def test_background_writer_runs_at_lower_priority_and_the_loop_does_not(tmp_path, nice):
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    storage = NiceProbeStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1, background_nice=nice)
    with g:
        g.step(1)
        g.wait()
        assert storage.nice == [min(19, loop_nice + (nice or 0))]
        g.save(2)  # a synchronous save (as an emergency) runs on the loop's thread, at its priority
        assert storage.nice[-1] == loop_nice
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice


@pytest.mark.parametrize("bad", [-1, 20, 2.5, "low"])
def test_background_nice_is_validated(tmp_path, bad):
    with pytest.raises(spotguard.ConfigError, match="background_nice"):
        spotguard.Guard(str(tmp_path), providers=[], background_nice=bad)


def test_busy_policy_skip_logs_and_skips(tmp_path, caplog):
    storage = GatedStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1, keep=10)
    with g:
        g.step(1)
        assert storage.writing.wait(5)
        g.step(2)  # due, but step 1 is still in flight
        assert g.stats().skipped == 1 and "skipped" in caplog.text
        storage.gate.set()
        g.wait()
        g.step(3)
    assert steps(storage) == [(1, "periodic"), (3, "final")] or steps(storage) == [(1, "periodic"), (3, "periodic")]


def test_busy_policy_wait_blocks_until_the_previous_commit(tmp_path):
    storage = GatedStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1, keep=10, busy="wait")
    with g:
        g.step(1)
        assert storage.writing.wait(5)
        t0 = time.monotonic()
        threading.Timer(0.3, storage.gate.set).start()
        g.step(2)
        assert time.monotonic() - t0 >= 0.25
        g.wait()
    assert steps(storage) == [(1, "periodic"), (2, "periodic")]


def test_staging_memory_is_reused_not_grown():
    staging = Staging(pin=False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    first = staging.snapshot(state)
    ptrs = sorted(t.data_ptr() for t in first["model"].values())
    size, allocations = staging.nbytes, staging.allocations
    for _ in range(5):
        opt.step()
        again = staging.snapshot({"model": model.state_dict(), "opt": opt.state_dict()})
    assert staging.nbytes == size and staging.allocations == allocations
    assert sorted(t.data_ptr() for t in again["model"].values()) == ptrs
    assert torch.equal(again["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert again["opt"]["state"][0]["exp_avg"].data_ptr() != opt.state_dict()["state"][0]["exp_avg"].data_ptr()


class FailingStorage(LocalStorage):
    def put_file(self, key, path, *, deadline=None):
        raise spotguard.StorageError("disk full")


def test_background_error_is_logged_at_once_and_raised_by_wait(tmp_path, caplog):
    g, _ = model_guard(FailingStorage(str(tmp_path)), every_steps=1, save_on_exit=False)
    with g:
        g.step(1)
        for _ in range(100):
            if "disk full" in caplog.text:
                break
            time.sleep(0.01)
        assert "disk full" in caplog.text  # logged by the worker, before anyone waits
        with pytest.raises(spotguard.StorageError, match="disk full"):
            g.wait()


def test_two_tiers_write_local_first_then_upload_and_resume_prefers_newest(tmp_path):
    local, durable = tmp_path / "nvme", tmp_path / "bucket"
    g, model = model_guard(str(durable), local_dir=str(local), every_steps=2, keep=2, busy="wait")
    with g:
        for s in range(1, 7):
            g.step(s)
        g.wait()
    assert steps(str(local)) == [(4, "periodic"), (6, "periodic")]  # retention per tier
    assert steps(str(durable)) == [(4, "periodic"), (6, "periodic")]
    assert g.stats().upload_Bps and g.stats().write_Bps
    # A stale local tier (e.g. a reused disk) is ignored when the durable tier is newer.
    checkpoint.delete(open_storage(str(local)), "step-00000006")
    fresh, _ = model_guard(str(durable), local_dir=str(local))
    assert fresh.resume() == 6
    # A corrupt durable copy falls back to the local copy of the same step.
    (durable / "step-00000006" / "state.pt").write_bytes(b"garbage")
    g2, _ = model_guard(str(durable), local_dir=str(local), every_steps=2, busy="wait")
    with g2:
        g2.step(8)
    checkpoint.delete(open_storage(str(durable)), "step-00000008")
    fresh, _ = model_guard(str(durable), local_dir=str(local))
    assert fresh.resume() == 8


def test_emergency_abandons_an_older_inflight_save_and_commits_the_newest(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="spotguard")
    storage = GatedStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1)
    with g:
        g.step(1)
        assert storage.writing.wait(5)
        g.watcher.report(Notice("test", "terminate"))
        threading.Timer(0.2, storage.gate.set).start()
        assert g.step(2) is True
    assert (2, "emergency") in steps(storage)
    assert "emergency checkpoint of step 2 committed" in caplog.text


def test_emergency_that_cannot_make_the_deadline_keeps_the_inflight_save(tmp_path, caplog):
    import datetime as dt

    storage = GatedStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1, save_on_exit=False)
    g.stats().write_Bps = 1.0  # measured: one byte per second, far too slow for the state
    g.stats().state_bytes = 10_000
    with g:
        g.step(1)
        assert storage.writing.wait(5)
        deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=2)
        g.watcher.report(Notice("test", "terminate", deadline=deadline))
        threading.Timer(0.2, storage.gate.set).start()
        assert g.step(3) is True
    assert steps(storage) == [(1, "periodic")]
    assert "2 step(s) will be lost" in caplog.text


class StuckUpload(LocalStorage):
    """A durable tier whose upload of step 1 hangs until released (a stalled transfer)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.started, self.release = threading.Event(), threading.Event()

    def put_file(self, key, path, *, deadline=None):
        if key.startswith("step-00000001/"):
            self.started.set()
            self.release.wait(30)
        return super().put_file(key, path, deadline=deadline)


def test_emergency_abandons_a_stuck_upload_and_neither_step_nor_exit_outlasts_the_deadline(tmp_path, caplog):
    import datetime as dt

    caplog.set_level(logging.INFO, logger="spotguard")
    durable = StuckUpload(str(tmp_path / "bucket"))
    g, _ = model_guard(durable, local_dir=str(tmp_path / "nvme"), every_steps=1, save_on_exit=False)
    try:
        with g:
            g.step(1)
            assert durable.started.wait(5)  # step 1 is on the local tier, its upload hangs
            deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
            g.watcher.report(Notice("test", "terminate", deadline=deadline))
            t0 = time.monotonic()
            assert g.step(2) is True
            took = time.monotonic() - t0
        exited = time.monotonic() - t0
    finally:
        durable.release.set()
    assert took < 8 and exited < 10, (took, exited)  # the stuck upload would hold them for 30 s
    assert steps(durable) == [(2, "emergency")]
    assert "abandoning the save of step 1" in caplog.text


def test_emergency_waits_for_an_inflight_save_when_both_fit_in_the_time_left(tmp_path, caplog):
    import datetime as dt

    storage = GatedStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1, save_on_exit=False)
    with g:
        g.step(1)
        assert storage.writing.wait(5)
        st = g.stats()
        st.write_s, st.write_Bps, st.state_bytes = 0.5, 1e9, 20_000  # measured: both saves take well under 10 s
        deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=10)
        g.watcher.report(Notice("test", "terminate", deadline=deadline))
        threading.Timer(0.2, storage.gate.set).start()
        assert g.step(2) is True
    assert steps(storage) == [(1, "periodic"), (2, "emergency")]  # nothing was thrown away


class GateFirst(LocalStorage):
    """Local storage whose first state-file store waits for ``gate`` (a periodic save held in flight);
    every store's key is recorded."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate, self.writing, self.stored = threading.Event(), threading.Event(), []

    def put_file(self, key, path, *, deadline=None):
        self.stored.append(key)
        if len(self.stored) == 1:
            self.writing.set()
            self.gate.wait(20)
        return super().put_file(key, path, deadline=deadline)


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
def test_a_stop_at_the_step_still_being_written_past_the_deadline_never_writes_it_twice(tmp_path, caplog):
    """The stop's step is the one in flight and its save outlasts the deadline: a second writer of the same
    folder could replace its files under the other's manifest (a committed checkpoint unlike its manifest)."""
    import datetime as dt

    storage = GateFirst(str(tmp_path))
    g, model = model_guard(storage, every_steps=1, save_on_exit=False)
    try:
        with g:
            g.step(1)
            assert storage.writing.wait(5)
            with torch.no_grad():
                model.weight.add_(1.0)  # step 1's state changes (an evaluation's RNG, an extra): other bytes
            deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=2)
            g.watcher.report(Notice("test", "terminate", deadline=deadline))
            assert g.step(1) is True
            storage.gate.set()  # the cancelled writer stores its file, then stops before its manifest
    finally:
        storage.gate.set()
    assert storage.stored == ["step-00000001/state.pt"], storage.stored  # one writer of step 1
    assert "not writing it a second time" in caplog.text
    for info in checkpoint.scan(open_storage(str(tmp_path))):
        if info.complete:
            checkpoint.verify(open_storage(str(tmp_path)), info)  # nothing committed unlike its manifest


def test_latest_and_stats_report_what_was_measured(tmp_path):
    g, model = model_guard(str(tmp_path), every_steps=2, save_on_exit=False, busy="wait")
    assert g.latest() is None
    with g:
        for step in range(1, 5):
            g.step(step)
        g.wait()
        info = g.latest()
        st = g.stats()
    assert info is not None and info.step == 4 and info.complete and info.manifest.reason == "periodic"
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert st.checkpoints == 2 and st.state_bytes >= size
    assert st.snapshot_s is not None and st.last_stall_s is not None and 0 < st.last_stall_s < 5
    assert st.write_s is not None and st.write_Bps is not None and st.write_Bps > 0


def test_an_async_checkpoint_records_extra_as_it_was_at_its_step(tmp_path, monkeypatch):
    """The loop may change ``guard.extra`` before the background save gets going; the manifest keeps
    the values of the step saved (here the writer is held before it starts)."""
    started, go = threading.Event(), threading.Event()
    real_write = layout.write

    def held_write(*args, **kwargs):
        started.set()
        assert go.wait(10), "test never let the save go"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(layout, "write", held_write)
    g, _ = model_guard(str(tmp_path), every_steps=5)
    with g:
        g.extra["epoch"] = 1
        g.step(5)
        assert started.wait(10)  # step 5 is in flight, its manifest not yet built
        g.extra["epoch"] = 2
        go.set()
        g.wait()
        saved = {i.step: i.manifest.extra for i in checkpoint.scan(open_storage(str(tmp_path))) if i.complete}
        assert saved == {5: {"epoch": 1}}
        g.extra["epoch"] = 3
    # Leaving the block saves the state after the loop: it changed, so it replaces step 5 (issue 17).
    saved = {
        i.step: (i.manifest.reason, i.manifest.extra)
        for i in checkpoint.scan(open_storage(str(tmp_path)))
        if i.complete
    }
    assert saved == {5: ("final", {"epoch": 3})}


class HeldStorage(LocalStorage):
    """Local storage whose file writes each wait for one ``release`` permit."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.release = threading.Semaphore(0)

    def put_file(self, key, path, *, deadline=None):
        assert self.release.acquire(timeout=10), "test never released the write"
        return super().put_file(key, path, deadline=deadline)


def test_busy_skip_is_logged_once_then_only_counted(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="spotguard")
    storage = HeldStorage(str(tmp_path))
    g, _ = model_guard(storage, every_steps=1)
    with g:
        g.step(1)  # held in flight
        g.step(2), g.step(3)  # skipped
        storage.release.release()
        g.wait()
        g.step(4)  # the next slow save
        g.step(5), g.step(6)  # skipped again
        for _ in range(3):
            storage.release.release()  # step 4, and the final save of step 6
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "skipped" in r.getMessage()]
    assert len(warned) == 1 and "guard.stats().skipped" in warned[0].getMessage(), [r.getMessage() for r in warned]
    assert g.stats().skipped == 4
    assert steps(str(tmp_path)) == [(1, "periodic"), (4, "periodic"), (6, "final")]


def test_the_same_state_serialises_to_the_same_bytes_whatever_its_strings_identities():
    """pickle memoises by identity: equal keys made apart (an optimizer's, or loaded from a checkpoint)
    would change the bytes, and the final save would rewrite an unchanged checkpoint."""
    import io

    from spotguard.checkpoint.state.snapshot import canonical

    def saved(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    key = "exp_avg"
    shared = {"state": [{key: torch.ones(2)}, {key: torch.zeros(2)}]}
    apart = {"state": [{"".join(["exp_", "avg"]): torch.ones(2)}, {"".join(["exp_", "avg"]): torch.zeros(2)}]}
    assert saved(shared) != saved(apart)
    assert saved(canonical(shared)) == saved(canonical(apart))
