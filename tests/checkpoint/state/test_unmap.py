"""After a resume nothing keeps the checkpoint file mapped: what an object keeps of the tensors of
``torch.load(mmap=True)`` it is given (an optimizer's state, LBFGS's history, a scheduler's tensor
learning rates) held a pruned checkpoint's disk space (or a downloaded copy's) until the process ended."""

from __future__ import annotations

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
def test_a_resume_leaves_the_file_unmapped(tmp_path, make):
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
    assert mapped(str(root)) == []  # a file deleted now gives its space back at once


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


def test_what_a_load_copies_or_moves_anyway_is_not_copied_first():
    """A copy there would only cost host memory: an optimizer's state for a parameter off the CPU (the
    meta device stands in for a GPU), spotguard's own adapters, a name nothing tracks."""
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    opt = torch.optim.AdamW([param])
    saved_state = {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}}
    states = {
        "optimizer": {"state": saved_state, "param_groups": [{**opt.state_dict()["param_groups"][0], "params": [0]}]},
        "ema": {"w": torch.ones(5)},
        "untracked": {"t": torch.ones(6)},
    }
    out = state.unmapped({"optimizer": opt, "ema": state.trackable("ema", {"w": torch.zeros(5)})}, states)
    entry = out["optimizer"]["state"][0]
    assert entry["exp_avg"] is saved_state[0]["exp_avg"] and entry["exp_avg_sq"] is saved_state[0]["exp_avg_sq"]
    assert entry["step"] is not saved_state[0]["step"]  # torch keeps `step` on the CPU, by reference
    assert out["ema"] is states["ema"] and out["untracked"] is states["untracked"]


def test_a_copied_parameter_is_still_a_parameter():
    p = torch.nn.Parameter(torch.ones(3))
    out = state.unmapped({"opt": object()}, {"opt": {"p": p, "frozen": torch.nn.Parameter(torch.ones(2), False)}})
    assert type(out["opt"]["p"]) is torch.nn.Parameter and out["opt"]["p"].is_leaf and out["opt"]["p"].requires_grad
    assert not out["opt"]["frozen"].requires_grad and out["opt"]["p"] is not p
