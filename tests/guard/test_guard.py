"""Guard behaviour in one process: when it saves, what a stop does, and what it leaves untouched."""

from __future__ import annotations

import logging
import random
import re
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard
from spotguard import Notice, checkpoint
from spotguard.errors import ConfigError
from spotguard.storage import LocalStorage, open_storage


def steps_in(root) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def guard_for(root, **kw) -> spotguard.Guard:
    g = spotguard.Guard(str(root), providers=[], **kw)
    g.track(model=torch.nn.Linear(2, 2))
    return g


def test_periodic_saves_every_n_steps_and_final_on_clean_exit(tmp_path):
    g = guard_for(tmp_path, every_steps=3, keep=10, busy="wait")
    with g:
        assert [g.step(s) for s in range(1, 8)] == [False] * 7
    assert steps_in(tmp_path) == [(3, "periodic"), (6, "periodic"), (7, "final")]


def test_no_final_save_when_the_loop_raises(tmp_path):
    g = guard_for(tmp_path, every_steps=100)
    with pytest.raises(RuntimeError), g:
        g.step(1)
        raise RuntimeError("nan loss")
    assert steps_in(tmp_path) == []


def test_time_based_schedule(tmp_path):
    g = guard_for(tmp_path, every_seconds=1.0, keep=100, busy="wait")
    with g:
        g.step(1)
        time.sleep(1.2)
        g.step(2)  # due: saved, and the next is due a second after it
        g.step(3)
    assert steps_in(tmp_path) == [(2, "periodic"), (3, "final")]


def test_notice_makes_step_save_once_and_return_true(tmp_path):
    g = guard_for(tmp_path, every_steps=100)
    with g:
        assert g.step(1) is False
        g.watcher.report(Notice("test", "terminate", raw={"n": 1}))
        assert g.step(2) is True
        assert g.step(3) is True  # still stopping; nothing more written
    assert g.stopped_at == 2 and g.notice is not None and g.notice.kind == "terminate"
    assert steps_in(tmp_path) == [(2, "emergency")]


def test_emergency_after_periodic_save_of_the_same_step_is_not_written_twice(tmp_path):
    g = guard_for(tmp_path, every_steps=2)
    with g:
        g.step(1)
        g.step(2)  # periodic save of step 2
        g.watcher.report(Notice("test", "terminate"))
        assert g.step(2) is True
    assert steps_in(tmp_path) == [(2, "periodic")]


def test_advisory_notice_brings_the_next_checkpoint_forward(tmp_path):
    g = guard_for(tmp_path, every_steps=1000)
    with g:
        g.step(1)
        g.watcher.report(Notice("test", "rebalance"))
        assert g.step(2) is False
        g.step(3)
    assert steps_in(tmp_path) == [(2, "advisory"), (3, "final")]


class DrawingStorage(LocalStorage):
    """Local storage that draws from every global RNG while writing, as some cloud SDKs do."""

    def put_file(self, key, path, *, deadline=None):
        random.random(), np.random.rand(), torch.rand(1)
        return super().put_file(key, path, deadline=deadline)


def test_saving_leaves_every_global_random_stream_untouched(tmp_path):
    g = spotguard.Guard(DrawingStorage(str(tmp_path)), providers=[])
    g.track(model=torch.nn.Linear(2, 2))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    g.save(1, "periodic")
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_resume_restores_every_global_random_stream_and_extra(tmp_path):
    g = guard_for(tmp_path)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    random.random(), np.random.rand(), torch.rand(3)
    g.extra.update(epoch=2, note="x")
    g.save(5, "periodic")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    fresh = guard_for(tmp_path)
    assert fresh.resume() == 5
    assert fresh.extra == {"epoch": 2, "note": "x"}
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_loader_with_its_own_generator_resumes_exactly(tmp_path):
    def make():
        return StatefulDataLoader(
            list(range(20)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    def batches(iterable):
        return [b.tolist() for b in iterable]

    ref_loader = make()
    it = iter(ref_loader)
    ref = [next(it).tolist() for _ in range(3)] + batches(it) + batches(ref_loader) + batches(ref_loader)
    loader = make()
    g = spotguard.Guard(str(tmp_path), providers=[]).track(loader=loader)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    g.save(3, "periodic")
    loader2 = make()
    spotguard.Guard(str(tmp_path), providers=[]).track(loader=loader2).resume()
    got += batches(loader2) + batches(loader2) + batches(loader2)
    assert got == ref


def test_plain_dataloader_gets_a_clear_warning(tmp_path):
    g = spotguard.Guard(str(tmp_path), providers=[])
    with pytest.warns(UserWarning, match="plain torch DataLoader"):
        g.track(loader=torch.utils.data.DataLoader(list(range(4))))
    stateful = StatefulDataLoader(list(range(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.track(loader=stateful)


def test_untrackable_objects_and_bad_options_are_rejected(tmp_path):
    g = spotguard.Guard(str(tmp_path), providers=[])
    with pytest.raises(ConfigError, match="state_dict"):
        g.track(thing=object())
    with pytest.raises(ConfigError, match="every_steps"):
        spotguard.Guard(str(tmp_path), every_steps=0)
    with pytest.raises(ConfigError, match="keep"):
        spotguard.Guard(str(tmp_path), keep=0)
    with pytest.raises(ConfigError, match="unsupported storage URL"):
        spotguard.Guard("ftp://host/x")
    with pytest.raises(ConfigError, match="every_steps"):
        spotguard.Guard(str(tmp_path), every_steps=True)
    with pytest.raises(ConfigError, match="providers is an empty string"):  # an unset variable in a script
        spotguard.Guard(str(tmp_path), providers="")


def test_a_local_tier_that_cannot_be_written_is_refused_when_the_guard_is_made(tmp_path, monkeypatch):
    """Not found out at every periodic save (each failed, training went on, the job exited 1 at the end)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPOTGUARD_LOCAL_DIR", str(tmp_path / "file" / "tier"))
    with pytest.raises(ConfigError, match=r"\$SPOTGUARD_LOCAL_DIR"):
        spotguard.Guard(str(tmp_path / "durable"), providers=[])
    monkeypatch.setenv("SPOTGUARD_LOCAL_DIR", str(tmp_path / "new" / "tier"))
    assert spotguard.Guard(str(tmp_path / "durable"), providers=[]).local is not None
    assert (tmp_path / "new" / "tier").is_dir()


def test_storage_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTGUARD_STORAGE", str(tmp_path / "env"))
    g = spotguard.Guard(providers=[]).track(model=torch.nn.Linear(1, 1))
    g.save(1)
    assert steps_in(tmp_path / "env") == [(1, "manual")]
    monkeypatch.delenv("SPOTGUARD_STORAGE")
    with pytest.raises(ConfigError, match="SPOTGUARD_STORAGE"):
        spotguard.Guard(providers=[])


class FailingStorage(LocalStorage):
    def put_file(self, key, path, *, deadline=None):
        raise spotguard.StorageError("bucket unreachable")


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_periodic_save_is_logged_and_training_goes_on(tmp_path, caplog, async_save):
    g = spotguard.Guard(FailingStorage(str(tmp_path)), providers=[], every_steps=1, busy="wait", async_save=async_save)
    g.track(model=torch.nn.Linear(1, 1))
    with pytest.raises(spotguard.StorageError, match="bucket unreachable"), g:
        assert [g.step(s) for s in (1, 2, 3)] == [False, False, False]
    assert caplog.text.count("bucket unreachable") >= 3  # logged when each happened
    assert g.stats().failures >= 3


def test_failed_emergency_save_still_stops_and_says_what_is_lost(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="spotguard")
    g = spotguard.Guard(FailingStorage(str(tmp_path)), providers=[])
    g.track(model=torch.nn.Linear(1, 1))
    with g:
        g.watcher.report(Notice("test", "terminate"))
        assert g.step(9) is True
    assert isinstance(g.emergency_error, spotguard.StorageError)
    assert "9 step(s) lost" in caplog.text


class SlowStorage(LocalStorage):
    """Every stored file costs ``delay`` seconds: a known checkpoint cost."""

    delay = 0.05

    def put_file(self, key, path, *, deadline=None):
        time.sleep(self.delay)
        return super().put_file(key, path, deadline=deadline)


def test_auto_interval_follows_the_measured_checkpoint_cost(tmp_path):
    from spotguard.planner import daly_interval

    g = spotguard.Guard(
        SlowStorage(str(tmp_path)), providers=[], every_seconds="auto", mtbf_hours=1.0, async_save=False, keep=1
    )
    g.track(model=torch.nn.Linear(2, 2))
    assert g.schedule.every_seconds() == 600.0  # before any measurement: the planner's starting guess
    for step in range(1, 6):
        g.save(step, "periodic")
    interval = g.schedule.every_seconds()
    # Measured cost >= the storage delay (plus a little serialisation): Young/Daly on 1 h MTBF.
    assert daly_interval(SlowStorage.delay, 3600) <= interval <= daly_interval(SlowStorage.delay * 4, 3600)
    assert g.schedule.due_time - time.monotonic() == pytest.approx(interval, abs=0.5)
    with pytest.raises(ConfigError, match="mtbf_hours"):
        spotguard.Guard(str(tmp_path), every_seconds="auto")


def test_sigint_inside_the_guard_is_a_stop_notice_and_a_second_one_interrupts(tmp_path, monkeypatch):
    """Ctrl-C (or `spotguard run` forwarding one) finishes the step and writes the emergency
    checkpoint; pressing it again raises KeyboardInterrupt at once; outside the guard nothing changes."""
    from spotguard.notices import signals

    monkeypatch.setattr(signals, "REPEAT_WINDOW", 0.05)  # a repeat sooner is the same stop (test_signals.py)
    before = signal.getsignal(signal.SIGINT)
    g = guard_for(tmp_path, every_steps=100)
    with g:
        g.step(1)
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt: a notice
        assert g.preempted.wait(5)
        assert g.step(2) is True
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert g.notice is not None and g.notice.raw == {"signal": "SIGINT"}
    assert steps_in(tmp_path) == [(2, "emergency")]
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_sigint_false_keeps_keyboardinterrupt(tmp_path):
    g = spotguard.Guard(str(tmp_path), providers=[], sigint=False).track(model=torch.nn.Linear(1, 1))
    with pytest.raises(KeyboardInterrupt), g:
        g.step(1)
        signal.raise_signal(signal.SIGINT)
    assert steps_in(tmp_path) == []


def test_resume_logs_one_info_line_with_step_reason_and_age(tmp_path, caplog):
    guard_for(tmp_path).save(5, "periodic")
    caplog.set_level(logging.INFO, logger="spotguard")
    assert guard_for(tmp_path).resume() == 5
    lines = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert len(lines) == 1 and re.match(r"resumed from step 5 \(periodic, \d+s old\) in ", lines[0]), lines
    assert [r.levelno for r in caplog.records if "resumed" in r.getMessage()] == [logging.INFO]


def test_plain_dataloader_warning_is_given_once(tmp_path, caplog):
    g = spotguard.Guard(str(tmp_path), providers=[])
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g.track(loader=torch.utils.data.DataLoader(list(range(4))))
    assert len([w for w in seen if "plain torch DataLoader" in str(w.message)]) == 1
    assert "plain torch DataLoader" not in caplog.text  # not a second time through logging


def manifest_of(root, step):
    (info,) = [i for i in checkpoint.scan(open_storage(str(root))) if i.step == step]
    return info.manifest


@pytest.mark.parametrize("async_save", [True, False])
def test_final_checkpoint_replaces_a_periodic_one_of_its_step_when_the_state_changed_after_it(tmp_path, async_save):
    model = torch.nn.Linear(2, 2)
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=2, keep=5, busy="wait", async_save=async_save)
    g.track(model=model)
    with g:
        g.step(1)
        g.step(2)  # periodic, the last step of the loop
        g.wait()
        assert steps_in(tmp_path) == [(2, "periodic")]
        with torch.no_grad():
            model.weight.fill_(3.0)  # after the last guard.step(): e.g. an end-of-epoch update
        g.extra["epoch"] = 1
    assert steps_in(tmp_path) == [(2, "final")]  # one checkpoint of step 2: the state after the loop
    assert manifest_of(tmp_path, 2).extra == {"epoch": 1}
    fresh_model = torch.nn.Linear(2, 2)
    fresh = spotguard.Guard(str(tmp_path), providers=[]).track(model=fresh_model)
    assert fresh.resume() == 2 and fresh.extra == {"epoch": 1} and torch.all(fresh_model.weight == 3.0)


@pytest.mark.parametrize("async_save", [True, False])
def test_final_checkpoint_is_not_written_again_when_nothing_changed(tmp_path, async_save):
    g = guard_for(tmp_path, every_steps=2, busy="wait", async_save=async_save)
    with g:
        g.step(1)
        g.step(2)
    written = manifest_of(tmp_path, 2)
    assert written.reason == "periodic"
    rerun = guard_for(tmp_path, every_steps=2)  # a finished job started again: resumes, runs no step
    assert rerun.resume() == 2
    with rerun:
        pass
    assert manifest_of(tmp_path, 2) == written  # the very same commit: not replaced by equal content


def test_final_checkpoint_removes_a_stale_local_copy_of_its_step(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    model = torch.nn.Linear(2, 2)
    g = spotguard.Guard(str(durable), providers=[], every_steps=2, busy="wait", local_dir=str(local))
    g.track(model=model)
    with g:
        g.step(1)
        g.step(2)
        g.wait()
        assert steps_in(local) == steps_in(durable) == [(2, "periodic")]
        g.extra["epoch"] = 1
    assert steps_in(durable) == [(2, "final")]
    assert steps_in(local) == []  # resume prefers the local tier: a stale copy of step 2 must not stay
    fresh = spotguard.Guard(str(durable), providers=[], local_dir=str(local)).track(model=torch.nn.Linear(2, 2))
    assert fresh.resume() == 2 and fresh.extra == {"epoch": 1}


class CtrlCWhileSaved(torch.nn.Linear):
    """A model whose state is read by the final save only: Ctrl-C arrives in the middle of it."""

    guard: spotguard.Guard | None = None

    def state_dict(self, *args, **kwargs):
        if self.guard is not None:
            assert self.guard.watcher.running  # notices are still watched during the final save
            signal.raise_signal(signal.SIGINT)
            assert self.guard.preempted.wait(10)  # recorded by the watcher, not raised
        return super().state_dict(*args, **kwargs)


def test_ctrl_c_during_the_final_checkpoint_is_recorded_and_the_checkpoint_committed(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    model = CtrlCWhileSaved(2, 2)
    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=100).track(model=model)
    with g:
        g.step(1)
        model.guard = g  # from here on: the final save
    assert steps_in(tmp_path) == [(1, "final")]
    assert g.notice is not None and g.notice.raw == {"signal": "SIGINT"}
    assert g.stopped_at is None  # a notice after the loop starts no second save
    assert not g.watcher.running and signal.getsignal(signal.SIGINT) is before


def test_the_watcher_is_stopped_even_when_the_final_checkpoint_raises(tmp_path):
    before = signal.getsignal(signal.SIGINT)

    class Broken(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            raise MemoryError("out of host memory")  # not an Exception: not kept by save_logged

    g = spotguard.Guard(str(tmp_path), providers=[], every_steps=100).track(model=Broken(2, 2))
    with pytest.raises(MemoryError), g:
        g.step(1)
    assert not g.watcher.running and signal.getsignal(signal.SIGINT) is before


def copy_tree(src, dst) -> None:
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True) if src.exists() else dst.mkdir(parents=True)


def test_a_kill_around_the_final_commit_never_loses_the_step_nor_resumes_the_stale_local_copy(tmp_path, monkeypatch):
    """The final save replaces step 2 on a two-tier guard. What a kill leaves just before and just after
    the durable manifest lands (copies of both tiers at those instants) must resume step 2: the old
    content before the commit (no newer one exists), the final content after it (never the stale
    local copy, which resume would otherwise prefer)."""
    from spotguard.checkpoint.folders import layout

    durable, local = tmp_path / "durable", tmp_path / "local"
    commit = layout._commit

    def commit_and_copy(storage, name, manifest, deadline, fence):
        if storage is g.storage and manifest.reason == "final":
            copy_tree(durable, tmp_path / "before" / "durable")
            copy_tree(local, tmp_path / "before" / "local")
        out = commit(storage, name, manifest, deadline, fence)
        if storage is g.storage and manifest.reason == "final":
            copy_tree(durable, tmp_path / "after" / "durable")
            copy_tree(local, tmp_path / "after" / "local")
        return out

    monkeypatch.setattr(layout, "_commit", commit_and_copy)
    model = torch.nn.Linear(2, 2)
    g = spotguard.Guard(str(durable), providers=[], every_steps=2, busy="wait", local_dir=str(local))
    g.track(model=model)
    with g:
        g.step(1)
        g.step(2)
        g.wait()
        assert steps_in(local) == steps_in(durable) == [(2, "periodic")]
        with torch.no_grad():
            model.weight.fill_(3.0)
        g.extra["epoch"] = 1
    assert steps_in(durable) == [(2, "final")] and steps_in(local) == []

    def resumed(where):
        fresh_model = torch.nn.Linear(2, 2)
        fresh = spotguard.Guard(str(where / "durable"), providers=[], local_dir=str(where / "local"))
        return fresh.track(model=fresh_model).resume(), fresh.extra, bool(torch.all(fresh_model.weight == 3.0))

    assert resumed(tmp_path / "before") == (2, {}, False)  # the periodic copy of step 2 survived
    assert resumed(tmp_path / "after") == (2, {"epoch": 1}, True)  # the final one, not the stale local copy


def test_periodic_saves_land_on_multiples_of_every_steps_after_a_resume_between_them(tmp_path):
    """HF's save_steps habit: a run resumed at step 7 (say an emergency checkpoint) saves at 10, 20, 30,
    not 17, 27; an advisory save between them does not shift them either."""
    g = guard_for(tmp_path, every_steps=10, keep=20, async_save=False)
    with g:
        for s in range(1, 8):
            g.step(s)
        g.save(7, "emergency")
        g.close(save=False)
    g = guard_for(tmp_path, every_steps=10, keep=20, async_save=False)
    start = g.resume()
    assert start == 7
    with g:
        for s in range(start + 1, 24):
            if s == 13:
                g.schedule.early()  # an advisory notice asked for a checkpoint at the next step
            g.step(s)
    assert steps_in(tmp_path) == [(7, "emergency"), (10, "periodic"), (13, "advisory"), (20, "periodic"), (23, "final")]


def test_steps_outside_the_with_block_warn_once_that_nothing_is_watched(tmp_path, caplog):
    """Without ``with guard:`` step() still checkpoints, so a run looks protected while no notice or signal
    is watched: one warning says so, on the first step; inside the block none."""
    guard = spotguard.Guard(str(tmp_path / "a"), providers=[], every_steps=100).track(model=torch.nn.Linear(2, 2))
    guard.resume()
    for step in range(1, 4):
        guard.step(step)
    assert caplog.text.count("outside `with guard:`") == 1
    guard.close(save=False)
    caplog.clear()
    inside = spotguard.Guard(str(tmp_path / "b"), providers=[], every_steps=100).track(model=torch.nn.Linear(2, 2))
    inside.resume()
    with inside:
        for step in range(1, 4):
            inside.step(step)
    assert "outside `with guard:`" not in caplog.text
