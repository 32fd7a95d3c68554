"""Fixtures of the integrations' in-process tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def accelerator():
    """``make(with_optimizer=...)``: a fresh CPU ``Accelerator`` in this process and a tiny model it prepared
    (with an SGD optimizer and a StepLR scheduler); Accelerate's process-wide state is reset after."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    def make(*, with_optimizer: bool):
        AcceleratorState._reset_state(True)  # a new run in this process
        acc = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2)
        if not with_optimizer:
            return acc, acc.prepare(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1))
        return acc, model

    yield make
    AcceleratorState._reset_state(True)
