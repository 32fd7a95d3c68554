"""A resume never drops saved state without a word: a checkpoint holding the state of an object that
nothing tracks now is refused, naming it, unless ``untracked="accept"`` (then a warning names it)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spotguard import Guard, heartbeat
from spotguard.errors import CheckpointMismatchError, ConfigError


def make(storage, *, only_model: bool = False, **options):
    """A model, its optimizer and scheduler, and a Guard tracking all three (or only the model)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    guard = Guard(str(storage), providers=[], **options)
    guard.track(model=model) if only_model else guard.track(model=model, optimizer=opt, scheduler=sched)
    return guard, model, opt, sched


def trained(storage, steps: int = 3) -> dict[str, torch.Tensor]:
    """Checkpoint ``steps`` steps of model, optimizer and scheduler; the model's weights then."""
    guard, model, opt, sched = make(storage)
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
    guard.save(steps)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_checkpoint_with_state_nothing_tracks_is_refused_naming_it(tmp_path):
    trained(tmp_path)
    guard, model, *_ = make(tmp_path, only_model=True)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of optimizer, scheduler, which nothing tracks"):
        guard.resume()
    assert all(torch.equal(fresh[k], v) for k, v in model.state_dict().items())  # nothing was loaded
    assert guard._beat.flags & heartbeat.CONFIG_ERROR  # `spotguard run` exits 78 instead of restarting


def test_untracked_accept_resumes_without_that_state_and_names_it(tmp_path, caplog):
    weights = trained(tmp_path)
    guard, model, *_ = make(tmp_path, only_model=True, untracked="accept")
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert guard.resume() == 3
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert "the saved state of optimizer, scheduler is not restored" in caplog.text


def test_tracking_everything_saved_resumes_as_before(tmp_path):
    weights = trained(tmp_path)
    guard, model, opt, sched = make(tmp_path)
    assert guard.resume() == 3
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert sched.last_epoch == 3


def test_an_unknown_untracked_policy_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'ignore' is not one of \['refuse', 'accept'\]"):
        Guard(str(tmp_path), providers=[], untracked="ignore")


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_checkpoint_with_an_untracked_optimizer_is_refused(tmp_path, group):
    trained(tmp_path)  # in a process group: the optimizer's state is in the DCP shards, not the rank file
    guard, *_ = make(tmp_path, only_model=True)
    with pytest.raises(CheckpointMismatchError, match=r"holds the state of optimizer, scheduler, which nothing"):
        guard.resume()
    accepting, model, *_ = make(tmp_path, only_model=True, untracked="accept")
    assert accepting.resume() == 3
