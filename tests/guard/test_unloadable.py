"""A checkpoint no resume could load fails at the first save; a resume that loads none raises, never restarts at 0."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import spotguard
from spotguard import checkpoint, heartbeat
from spotguard.checkpoint.lease import LEASE
from spotguard.errors import CheckpointMismatchError, NoLoadableCheckpointError, UnloadableStateError
from spotguard.storage import open_storage


class LossScaler:
    """Like DeepSpeed's ``LossScaler``: an object a state dict holds whole."""

    def __init__(self, scale: float = 2.0**16) -> None:
        self.cur_scale = scale


class Engine:
    """A tracked object whose state_dict() holds a ``LossScaler`` (as a DeepSpeed engine's did)."""

    def __init__(self) -> None:
        self.scaler = LossScaler()

    def state_dict(self):
        return {"loss_scaler": self.scaler}

    def load_state_dict(self, sd) -> None:
        self.scaler = sd["loss_scaler"]


def committed(root) -> list[int]:
    return [i.step for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def make(root, **kw) -> tuple[spotguard.Guard, nn.Linear, Engine]:
    torch.manual_seed(0)
    model, engine = nn.Linear(2, 2), Engine()
    guard = spotguard.Guard(str(root), providers=[], **kw).track(model=model, engine=engine)
    return guard, model, engine


def config_flag(guard: spotguard.Guard) -> bool:
    return bool(guard._beat.flags & heartbeat.CONFIG_ERROR)


@pytest.mark.parametrize("how", ["periodic-sync", "periodic-async", "manual", "final"])
def test_the_first_save_refuses_a_state_no_resume_could_load(tmp_path, how):
    guard, _, _ = make(tmp_path, every_steps=2, async_save=how == "periodic-async", busy="wait")
    reached = []
    with pytest.raises(UnloadableStateError, match=r"'engine': its state_dict\(\)\['loss_scaler'\] is a .*LossScaler"):
        if how == "manual":
            guard.save(1)
        elif how == "final":
            with guard:
                guard.step(1)  # every_steps=2: only the final checkpoint of step 1 is written
        else:
            with guard:
                for step in range(1, 5):
                    reached.append(step)
                    guard.step(step)
    if how == "periodic-sync":
        assert reached == [1, 2]  # raised by the step that saves, not kept for the end as a passing failure
    if how == "periodic-async":  # sooner: by the first step, whose staging reservation walks the state
        assert reached == [1]
    # nothing written, nothing to skip later (but the run's writer lease, taken before anything is written)
    assert committed(tmp_path) == [] and not [p for p in tmp_path.iterdir() if not p.name.startswith(LEASE)]
    assert config_flag(guard)  # `spotguard run` does not restart into the same error


def test_a_class_the_user_allows_is_saved_and_resumed(tmp_path):
    guard, _, engine = make(tmp_path)
    engine.scaler = LossScaler(1024.0)
    with torch.serialization.safe_globals([LossScaler]):
        guard.save(3)
        again, _, engine2 = make(tmp_path)
        assert again.resume() == 3
    assert engine2.scaler.cur_scale == 1024.0


def test_resume_raises_when_checkpoints_exist_but_none_loads(tmp_path, caplog):
    guard, _, _ = make(tmp_path, keep=5)
    with torch.serialization.safe_globals([LossScaler]):  # allowed while saving, not when resuming
        guard.save(3)
        guard.save(6)
    fresh, _, _ = make(tmp_path)
    with pytest.raises(NoLoadableCheckpointError) as caught:
        fresh.resume()
    text = str(caught.value)
    assert "2 checkpoint(s) and none of them loads" in text
    assert "step-00000006/state.pt: cannot be loaded safely" in text and "step-00000003" in text
    assert "LossScaler" in text and "on_unloadable='fresh'" in text
    assert config_flag(fresh)
    assert not list(tmp_path.rglob("corrupt.json"))  # their bytes are as saved: a load refused is no corruption
    assert committed(tmp_path) == [3, 6]

    on_purpose, _, _ = make(tmp_path, on_unloadable="fresh")
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert on_purpose.resume() == 0
    assert (
        "loads (" in caplog.text
        and "LossScaler" in caplog.text
        and "starting from step 0 (on_unloadable='fresh')" in caplog.text
    )
    assert not config_flag(on_purpose)


def test_only_an_unfinished_save_is_no_checkpoint_and_resume_starts_at_zero(tmp_path):
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "state.pt").write_bytes(b"cut short")  # killed before its manifest
    guard, _, _ = make(tmp_path)
    guard.track(engine=nn.Linear(1, 1))
    assert guard.resume() == 0


def test_a_bad_on_unloadable_is_rejected(tmp_path):
    with pytest.raises(spotguard.ConfigError, match="'later'"):
        spotguard.Guard(str(tmp_path), providers=[], on_unloadable="later")


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_first_save_refuses_and_resume_raises_when_none_loads(tmp_path, group):
    guard, _, _ = make(tmp_path, async_save=False)
    try:
        with pytest.raises(UnloadableStateError, match="'engine'"):
            guard.save(1)
        assert committed(tmp_path) == [] and config_flag(guard)
        with torch.serialization.safe_globals([LossScaler]):
            guard.save(2)
    finally:
        guard.close(save=False)
    fresh, _, _ = make(tmp_path)
    try:
        with pytest.raises(NoLoadableCheckpointError, match=r"step-00000002: .*rank-00000.pt: cannot be loaded"):
            fresh.resume()
    finally:
        fresh.close(save=False)
    assert not list(tmp_path.rglob("corrupt.json")) and committed(tmp_path) == [2]  # not corrupt: unloadable here
    on_purpose, _, _ = make(tmp_path, on_unloadable="fresh")
    try:
        assert on_purpose.resume() == 0
    finally:
        on_purpose.close(save=False)


def test_a_resume_that_does_not_fit_is_marked_not_to_be_restarted(tmp_path):
    guard, _, _ = make(tmp_path)
    with torch.serialization.safe_globals([LossScaler]):
        guard.save(1)
        other = spotguard.Guard(str(tmp_path), providers=[]).track(model=nn.Linear(3, 3))
        with pytest.raises(CheckpointMismatchError):
            other.resume()
    assert config_flag(other)
