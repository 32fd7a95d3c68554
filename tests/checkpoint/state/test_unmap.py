"""After a resume nothing keeps the checkpoint file mapped: what an object keeps of the tensors of
``torch.load(mmap=True)`` it is given (an optimizer's state, LBFGS's history, a scheduler's tensor
learning rates) held a pruned checkpoint's disk space (or a downloaded copy's) until the process ended."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

import spotguard
from spotguard.checkpoint.state import state


def mapped(path_part: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if path_part in line]


def _adamw() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, {"model": model, "optimizer": opt}


def _lbfgs() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=4)
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    return model, {"model": model, "optimizer": opt}


def _scheduler() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    opt.step()
    sched.step()
    return model, {"model": model, "optimizer": opt, "scheduler": sched}


@pytest.mark.parametrize("make", [_adamw, _lbfgs, _scheduler], ids=["adamw", "lbfgs-history", "tensor-lr-scheduler"])
def test_a_resume_leaves_the_file_unmapped_and_its_space_free_when_deleted(tmp_path, make):
    root = tmp_path / "ck"
    _, objects = make()
    g = spotguard.Guard(str(root), providers=[], save_on_exit=False)
    g.track(**objects)
    g.save(3)
    g.close()

    _, fresh = make()
    g = spotguard.Guard(str(root), providers=[], save_on_exit=False)
    g.track(**fresh)
    assert g.resume() == 3
    g.close()
    assert mapped(str(root)) == []
    state_file = next(root.rglob("state.pt"))
    before = os.statvfs(root).f_bfree
    state_file.unlink()
    assert os.statvfs(root).f_bfree > before  # the space came back at once, not at the process's end


def test_a_resumed_cpu_optimizer_trains_on_exactly_like_the_saved_one(tmp_path):
    model, objects = _adamw()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(**objects)
    g.save(3)
    g.close()
    model2, fresh = _adamw()
    with torch.no_grad():
        model2.weight.zero_()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(**fresh)
    g.resume()
    g.close()
    for m, o in ((model, objects["optimizer"]), (model2, fresh["optimizer"])):
        m.zero_grad()
        torch.manual_seed(1)
        m(torch.randn(2, 64)).sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)
    assert torch.equal(
        objects["optimizer"].state[model.weight]["exp_avg_sq"], fresh["optimizer"].state[model2.weight]["exp_avg_sq"]
    )


def test_only_what_a_module_does_not_copy_is_copied_and_a_shared_tensor_stays_shared():
    shared, weight = torch.ones(3), torch.ones(4)
    module_state = OrderedDict(weight=weight)
    states = {
        "model": module_state,
        "opt": {"a": [shared, (shared, 1)], "b": {"c": shared}, "gpu_or_empty": torch.ones(0)},
    }
    out = state.unmapped({"model": torch.nn.Linear(1, 1), "opt": object()}, states)
    assert out["model"] is module_state  # load_state_dict copies a module's tensors itself
    a, (b, one), c = out["opt"]["a"][0], out["opt"]["a"][1], out["opt"]["b"]["c"]
    assert a is b is c and a is not shared and torch.equal(a, shared) and one == 1
    assert out["opt"]["gpu_or_empty"] is states["opt"]["gpu_or_empty"]
    assert states["opt"]["a"][0] is shared  # the payload itself is not changed
