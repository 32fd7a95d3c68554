"""track() beyond state_dict(): tensors, dicts and lists restored in place, spotguard.Value holders."""

from __future__ import annotations

import pytest
import torch

import spotguard
from spotguard.errors import CheckpointMismatchError, ConfigError


def guard(root) -> spotguard.Guard:
    return spotguard.Guard(str(root), providers=[], sigint=False)


def test_a_tracked_tensor_is_restored_into_the_same_tensor(tmp_path):
    guard(tmp_path).track(h=torch.arange(6.0).view(2, 3)).save(2)
    h = torch.zeros(2, 3)
    assert guard(tmp_path).track(h=h).resume() == 2
    assert torch.equal(h, torch.arange(6.0).view(2, 3))  # the loop's own reference sees the restored values


def test_a_tracked_dict_of_ema_tensors_keeps_its_identity_and_its_tensors(tmp_path):
    model = torch.nn.Linear(3, 3)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for v in ema.values():
            v.add_(1.0)
    expected = {k: v.clone() for k, v in ema.items()}
    guard(tmp_path).track(ema=ema).save(1)
    fresh = {k: torch.zeros_like(v) for k, v in ema.items()}
    weight = fresh["weight"]
    guard(tmp_path).track(ema=fresh).resume()
    assert fresh["weight"] is weight  # an alias held elsewhere in the loop keeps working
    assert all(torch.equal(fresh[k], expected[k]) for k in expected)


def test_a_tracked_list_is_restored_in_place(tmp_path):
    history = [1.5, 2.5, "x"]
    guard(tmp_path).track(history=history).save(1)
    fresh: list = []
    guard(tmp_path).track(history=fresh).resume()
    assert fresh == [1.5, 2.5, "x"]


def test_value_holds_state_the_loop_rebinds(tmp_path):
    hidden, tokens = spotguard.Value((torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0))), spotguard.Value(1536)
    notes = spotguard.Value({"best": 0.5, "seen": [1, 2, None, True], "name": "run"})
    guard(tmp_path).track(hidden=hidden, tokens=tokens, notes=notes).save(3)
    h0 = torch.zeros(1, 2, 4)
    hidden2, tokens2, notes2 = spotguard.Value((h0, h0)), spotguard.Value(0), spotguard.Value(None)
    assert guard(tmp_path).track(hidden=hidden2, tokens=tokens2, notes=notes2).resume() == 3
    assert tokens2.value == 1536 and notes2.value == {"best": 0.5, "seen": [1, 2, None, True], "name": "run"}
    assert isinstance(hidden2.value, tuple) and torch.equal(hidden2.value[1], torch.full((1, 2, 4), 2.0))
    assert torch.equal(h0, torch.zeros(1, 2, 4))  # a shared initial state is replaced, never written into


def test_values_that_cannot_be_restored_in_place_are_refused_with_the_way_out(tmp_path):
    g = guard(tmp_path)
    with pytest.raises(ConfigError, match=r"spotguard\.Value.*|guard\.extra"):
        g.track(epoch=3)
    with pytest.raises(ConfigError, match="spotguard.Value"):
        g.track(hidden=(torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ConfigError, match="requires grad"):
        g.track(w=torch.zeros(2, requires_grad=True))
    with pytest.raises(ConfigError, match="set"):
        g.track(seen={"ids": {1, 2}})
    with pytest.raises(ConfigError, match="give it those two methods"):
        g.track(sampler=object())
    bad = spotguard.Value(object())
    g.track(bad=bad)
    with pytest.raises(ConfigError, match="object cannot be checkpointed"):
        g.save(1)


def test_a_tensor_of_another_shape_is_a_mismatch_not_a_silent_reshape(tmp_path):
    guard(tmp_path).track(h=torch.zeros(4)).save(1)
    with pytest.raises(CheckpointMismatchError, match="'h'.*shape"):
        guard(tmp_path).track(h=torch.zeros(5)).resume()


def test_a_generator_is_tracked_and_continues_its_stream_after_resume(tmp_path):
    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)
    guard(tmp_path).track(eval_rng=gen).save(1)
    want = torch.rand(5, generator=gen)  # what the uninterrupted run draws next
    fresh = torch.Generator().manual_seed(99)
    assert guard(tmp_path).track(eval_rng=fresh).resume() == 1
    assert torch.equal(torch.rand(5, generator=fresh), want)


def test_a_generator_state_that_does_not_fit_is_a_mismatch(tmp_path):
    guard(tmp_path).track(eval_rng=torch.zeros(3, dtype=torch.uint8)).save(1)
    with pytest.raises(CheckpointMismatchError, match="eval_rng"):
        guard(tmp_path).track(eval_rng=torch.Generator()).resume()
