"""AcceleratorGuard warns about a prepared loader whose position cannot be saved, as Guard.track() does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from spotguard.integrations.accelerate import AcceleratorGuard  # noqa: E402


@pytest.fixture
def accelerator():
    made = []

    def make(stateful: bool):
        acc = accelerate.Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
        )
        made.append(acc)
        return acc

    yield make
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("given", [DataLoader, StatefulDataLoader])
def test_a_loader_prepared_without_state_gets_the_guards_warning(tmp_path, accelerator, given):
    acc = accelerator(stateful=False)
    acc.prepare(torch.nn.Linear(2, 2), given(list(range(8)), batch_size=2))  # a plain DataLoader either way
    guard = AcceleratorGuard(acc, str(tmp_path), providers=[])
    with pytest.warns(
        UserWarning, match=r"'prepared loader 0' is a plain torch DataLoader.*use_stateful_dataloader=True"
    ):
        assert guard.resume() == 0


def test_a_stateful_prepared_loader_gets_no_warning(tmp_path, accelerator):
    acc = accelerator(stateful=True)
    acc.prepare(torch.nn.Linear(2, 2), DataLoader(list(range(8)), batch_size=2))
    guard = AcceleratorGuard(acc, str(tmp_path), providers=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert guard.resume() == 0
    assert not [w for w in seen if "plain torch DataLoader" in str(w.message)]
