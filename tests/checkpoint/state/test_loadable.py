"""The first save's check that a state loads back with torch.load(weights_only=True), on real torch objects."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard.checkpoint import scan
from spotguard.checkpoint.engine import Tracked
from spotguard.checkpoint.sharded.sharded import ShardedEngine
from spotguard.checkpoint.single import SingleEngine
from spotguard.checkpoint.state import loadable
from spotguard.errors import ConfigError, UnloadableStateError
from spotguard.storage import LocalStorage


class LossScaler:
    """Like DeepSpeed's: an object kept whole in a state dict."""

    def __init__(self) -> None:
        self.cur_scale = 2.0**16
        self.cur_iter = 7


class Mode(enum.Enum):
    WARMUP = 1


class Holder:
    """A tracked object whose state_dict() holds ``value`` under ``key``."""

    def __init__(self, **state) -> None:
        self.state = state

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, sd) -> None:
        self.state = dict(sd)


def trained_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    loader = StatefulDataLoader(list(range(10)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    next(iter(loader))
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict(), "loader": loader}


def test_a_real_training_state_passes():
    state = trained_state()
    state["loader"] = state["loader"].state_dict()
    loadable.check(state)
    loadable.check({"params": {"w": nn.Parameter(torch.ones(2)), "b": torch.ones(2, dtype=torch.bfloat16)}})


@pytest.mark.parametrize(
    ("value", "path", "kind"),
    [
        ({"loss_scaler": LossScaler()}, "['loss_scaler']", "LossScaler"),
        ({"groups": [{"lr": 0.1, "mode": Mode.WARMUP}]}, "['groups'][0]['mode']", "Mode"),
        ({"ema": np.zeros(3)}, "['ema']", "numpy.ndarray"),
        ({"count": np.int64(3)}, "['count']", "numpy.int64"),
    ],
)
def test_a_value_weights_only_refuses_is_named_with_its_object_path_and_type(value, path, kind):
    with pytest.raises(UnloadableStateError) as caught:
        loadable.check({"model": {"w": torch.ones(2)}, "scaler": value})
    text = str(caught.value)
    assert isinstance(caught.value, ConfigError)
    assert f"tracked object 'scaler': its state_dict(){path} is a " in text and kind in text
    assert "Unsupported global" in text and "add_safe_globals([" in text and "Nothing was written" in text


def test_the_users_safe_globals_are_honoured():
    state = {"scaler": {"loss_scaler": LossScaler()}}
    with pytest.raises(UnloadableStateError):
        loadable.check(state)
    with torch.serialization.safe_globals([LossScaler]):
        loadable.check(state)


def test_as_items_lets_tensor_subclasses_through_but_not_what_surrounds_them():
    class Tagged(torch.Tensor):
        pass

    tagged = torch.ones(2).as_subclass(Tagged)
    with pytest.raises(UnloadableStateError, match="Tagged"):
        loadable.check({"model": {"w": tagged}})  # written whole into state.pt: its class is pickled
    loadable.check({"model": {"w": tagged}}, as_items=True)  # a DCP tensor item
    with pytest.raises(UnloadableStateError, match=r"\['mode'\]"):
        loadable.check({"model": {"w": tagged, "mode": Mode.WARMUP}}, as_items=True)


@pytest.mark.parametrize("staged", [False, True])
def test_single_engine_refuses_at_the_first_save_and_writes_nothing(tmp_path, staged):
    storage = LocalStorage(str(tmp_path))
    engine = SingleEngine(storage, None, keep=3, on_commit=lambda c: None)
    tracked = Tracked({"model": nn.Linear(2, 2), "scaler": Holder(loss_scaler=LossScaler())}, {})
    with pytest.raises(UnloadableStateError, match="'scaler'"):
        if staged:
            engine.stage(tracked, 1, "periodic")
        else:
            engine.save(tracked, 1, "periodic")
    assert scan(storage) == [] and list(tmp_path.iterdir()) == []
    tracked.objects["scaler"] = Holder(loss_scaler=vars(LossScaler()))  # its fields as plain values
    assert engine.save(tracked, 1, "periodic") is not None


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_engine_refuses_values_of_the_dcp_state_and_of_the_rank_file(tmp_path, group):
    from spotguard.coordination import agreement

    storage = LocalStorage(str(tmp_path))
    groups = agreement.setup(1, async_save=False)
    assert groups is not None
    engine = ShardedEngine(storage, groups, keep=3, on_commit=lambda c: None)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["mode"] = Mode.WARMUP  # written by DCP as a byte item, read back with weights_only
    try:
        with pytest.raises(UnloadableStateError, match=r"'optimizer'.*Mode"):
            engine.save(Tracked({"model": model, "optimizer": opt}, {}), 1, "periodic")
        del opt.param_groups[0]["mode"]
        with pytest.raises(UnloadableStateError, match=r"'scaler'.*LossScaler"):
            engine.save(Tracked({"model": model, "scaler": Holder(s=LossScaler())}, {}), 1, "periodic")
        assert scan(storage) == []
        assert engine.save(Tracked({"model": model, "optimizer": opt}, {}), 1, "periodic") is not None
    finally:
        groups.close()


def test_sharded_staged_save_refuses_on_its_rank_before_anything_is_written(tmp_path):
    groups = SimpleNamespace(rank=0, world_size=1, store=dist.HashStore(), uid="t", timeout_s=5.0, save_group=None)
    engine = ShardedEngine(LocalStorage(str(tmp_path)), groups, keep=3, on_commit=lambda c: None)
    with pytest.raises(UnloadableStateError, match="'scaler'"):
        engine.stage(Tracked({"model": nn.Linear(2, 2), "scaler": Holder(s=LossScaler())}, {}), 1, "periodic")
    assert list(tmp_path.iterdir()) == []
