"""After a resume nothing keeps the checkpoint file mapped: an optimizer keeps the tensors of
``torch.load(mmap=True)`` it is given, which held a pruned checkpoint's disk space (or a downloaded
copy's) until the process ended."""

from __future__ import annotations

import os

import torch

import spotguard
from spotguard.checkpoint.state import state


def mapped(path_part: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if path_part in line]


def _run(lr: float | torch.Tensor) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return model, opt


def test_a_resumed_cpu_optimizer_holds_no_part_of_the_file_and_trains_on_the_same(tmp_path):
    root = tmp_path / "ck"
    model, opt = _run(torch.tensor(1e-3))  # a tensor lr: kept by reference in param_groups too
    g = spotguard.Guard(str(root), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.save(3)
    g.close()

    model2, opt2 = _run(torch.tensor(5e-2))
    g = spotguard.Guard(str(root), providers=[], save_on_exit=False)
    g.track(model=model2, optimizer=opt2)
    assert g.resume() == 3
    g.close()
    assert mapped(str(root)) == []
    state_file = next(root.rglob("state.pt"))
    before = os.statvfs(root).f_bfree
    state_file.unlink()
    assert os.statvfs(root).f_bfree > before  # the space came back at once, not at the process's end

    for m, o in ((model, opt), (model2, opt2)):
        m.zero_grad()
        torch.manual_seed(1)
        m(torch.randn(2, 256)).sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)
    assert torch.equal(opt.state[model.weight]["exp_avg_sq"], opt2.state[model2.weight]["exp_avg_sq"])


def test_unmap_copies_only_what_an_optimizer_kept_of_the_loaded_states():
    model, opt = _run(1e-3)
    states = {"optimizer": opt.state_dict()}
    fresh_model, fresh = _run(1e-3)
    fresh.load_state_dict(states["optimizer"])
    kept = fresh.state[fresh_model.weight]["exp_avg"]
    assert kept.data_ptr() == states["optimizer"]["state"][0]["exp_avg"].data_ptr()  # torch keeps it
    copied = state.unmap({"model": fresh_model, "optimizer": fresh}, states)
    now = fresh.state[fresh_model.weight]["exp_avg"]
    assert now.data_ptr() != kept.data_ptr() and torch.equal(now, kept)
    per_param = sum(t.numel() * t.element_size() for t in opt.state[model.weight].values())
    assert copied == per_param + sum(t.numel() * t.element_size() for t in opt.state[model.bias].values())
    assert state.unmap({"optimizer": fresh}, states) == 0  # nothing left to copy


def test_a_tensor_an_optimizer_keeps_in_two_places_stays_one_tensor():
    model, opt = _run(1e-3)
    shared = torch.zeros(3)
    states = {"optimizer": {"t": shared}}
    opt.state[model.weight]["shared"] = shared
    opt.state[model.bias]["shared"] = shared
    assert state.unmap({"optimizer": opt}, states) == shared.numel() * shared.element_size()
    a, b = opt.state[model.weight]["shared"], opt.state[model.bias]["shared"]
    assert a is b and a is not shared
