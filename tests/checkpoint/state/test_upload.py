"""The resume's copy of a verified checkpoint's tensors to their devices, before ``load_state_dict``.

Here the "device" is the CPU (``wanted`` accepts it), so the plan, the file offsets, the chunked ring and
the fallbacks run without CUDA; tests/test_gpu.py runs the same path to a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

import spotguard
from spotguard.checkpoint.state import upload


def _cpu(d: torch.device) -> bool:
    return d.type == "cpu"


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.BatchNorm1d(33), torch.nn.Linear(33, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    """A payload as the single engine loads it: torch.load(mmap=True) of the saved state dicts."""
    model, opt = trained()
    path = tmp_path / "state.pt"
    torch.save(
        {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict(), "note": {"t": torch.ones(3)}}}, path
    )
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return model, opt, path, payload["objects"]


def test_the_plan_is_what_load_state_dict_would_copy_to_the_device_and_nothing_else(saved):
    model, opt, _, states = saved
    plan = upload.moves({"model": model, "optimizer": opt, "note": object()}, states, wanted=_cpu)
    planned = {(id(m.holder), m.key) for m in plan}
    for key in model.state_dict():
        assert (id(states["model"]), key) in planned
    for entry in states["optimizer"]["state"].values():
        assert (id(entry), "exp_avg") in planned and (id(entry), "exp_avg_sq") in planned
        assert (id(entry), "step") not in planned  # torch keeps a non-capturable step where it is
    assert not any(m.holder is states["note"] for m in plan)  # an object of no known kind: left to itself
    assert upload.moves({"model": model, "optimizer": opt}, states) == []  # nothing lives on a GPU here


def test_a_live_tensor_of_another_shape_is_left_for_load_state_dict_to_refuse(saved):
    _, opt, _, states = saved
    other = torch.nn.Sequential(torch.nn.Linear(64, 34), torch.nn.BatchNorm1d(34), torch.nn.Linear(34, 5))
    plan = upload.moves({"model": other}, states, wanted=_cpu)
    assert {m.key for m in plan} == {"1.num_batches_tracked", "2.bias"}  # the entries whose shape still matches


@pytest.mark.parametrize("located", [True, False], ids=["pread-at-file-offsets", "copied-from-the-mapping"])
def test_upload_copies_every_byte_in_chunks_on_several_threads(saved, monkeypatch, located):
    model, opt, path, states = saved
    plan = upload.moves({"model": model, "optimizer": opt}, states, wanted=_cpu)
    originals = [m.tensor.clone() for m in plan]
    offsets = upload.file_offsets(path, [m.tensor for m in plan])
    assert len(offsets) == len(plan)  # every mapped tensor found in the file through /proc/self/maps
    if not located:
        monkeypatch.setattr(upload, "file_offsets", lambda path, tensors: {})
    moved = upload.upload(plan, path, threads=3, chunk=1000)  # odd chunk: tensors end mid-buffer
    assert moved == sum(t.numel() * t.element_size() for t in originals)
    for m, before in zip(plan, originals, strict=True):
        after = m.holder[m.key]
        assert after is not m.tensor and torch.equal(after, before) and after.dtype == before.dtype
        assert not (m.tensor.data_ptr() <= after.data_ptr() < m.tensor.data_ptr() + 1)  # a copy, not the map


def test_a_resume_through_the_upload_is_exact_and_a_failed_upload_changes_nothing(tmp_path, monkeypatch, caplog):
    """The Guard's resume with the CPU treated as the device: the same state as a plain resume; an upload
    that fails half way leaves the payload as loaded, and load_state_dict copies it instead."""
    model, opt = trained()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.resume()
    g.save(3)
    g.close()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(upload, "_cuda", _cpu)
    monkeypatch.setattr(upload, "_fits", lambda todo: True)
    calls = []
    real = upload.upload
    monkeypatch.setattr(
        upload, "upload", lambda todo, path, **kw: calls.append(len(todo)) or real(todo, path, chunk=4096, **kw)
    )
    for failing in (False, True):
        if failing:
            monkeypatch.setattr(upload, "_pread_into", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.BatchNorm1d(33), torch.nn.Linear(33, 5))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        g2 = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
        g2.track(model=fresh, optimizer=fresh_opt)
        with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.state.upload"):
            assert g2.resume() == 3
        g2.close()
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        for pid, entry in opt.state_dict()["state"].items():
            for k, v in entry.items():
                assert torch.equal(v, fresh_opt.state_dict()["state"][pid][k])
        assert ("disk gone" in caplog.text) is failing
    assert calls and calls[0] > 0


def test_each_tensor_reaches_its_own_device_when_one_thread_serves_two(saved):
    """A thread's buffers are per device: a tensor for another device is not put on the first one's."""
    model, opt, path, states = saved
    plan = [
        m._replace(device=torch.device("meta" if i % 2 else "cpu"))
        for i, m in enumerate(upload.moves({"model": model, "optimizer": opt}, states, wanted=_cpu))
    ]
    upload.upload(plan, path, threads=1, chunk=4096)
    assert [m.holder[m.key].device for m in plan] == [m.device for m in plan]


def test_objects_that_load_their_own_way_are_left_alone(saved):
    """Torch's placement rule is only sure for torch's own load_state_dict without load hooks."""
    model, opt, _, states = saved

    class KeepsWhatItIsGiven(torch.nn.Sequential):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # type: ignore[override]
            self.kept = state_dict

    class OwnOptimizer(torch.optim.AdamW):
        def load_state_dict(self, state_dict):  # type: ignore[override]
            self.kept = state_dict

    own = KeepsWhatItIsGiven(*model)
    own_opt = OwnOptimizer(own.parameters(), lr=1e-2)
    assert upload.moves({"model": own, "optimizer": own_opt}, states, wanted=_cpu) == []
    hooked = torch.nn.Sequential(*model)
    hooked._register_load_state_dict_pre_hook(lambda *a, **k: None)
    assert upload.moves({"model": hooked}, states, wanted=_cpu) == []
    assert upload.moves({"model": model, "optimizer": opt}, states, wanted=_cpu)  # the plain ones are planned


def test_a_failure_while_planning_never_fails_the_resume(saved, monkeypatch, caplog):
    _, _, path, states = saved

    class Broken(torch.nn.Linear):
        def state_dict(self, *a, **k):  # type: ignore[override]
            raise RuntimeError("state_dict exploded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(upload, "_plain", lambda *a: True)
    with caplog.at_level(logging.WARNING, logger="spotguard.checkpoint.state.upload"):
        assert upload.to_devices({"model": Broken(2, 2)}, states, path) == 0
    assert "state_dict exploded" in caplog.text


def test_bytes_read_at_a_wrong_offset_are_refused_not_loaded(saved, monkeypatch):
    model, opt, path, states = saved
    plan = upload.moves({"model": model, "optimizer": opt}, states, wanted=_cpu)
    before = {id(m.holder): dict(m.holder) for m in plan}
    real = upload.file_offsets
    monkeypatch.setattr(upload, "file_offsets", lambda p, ts: {i: off + 64 for i, off in real(p, ts).items()})
    with pytest.raises(OSError, match="wrong offset"):
        upload.upload(plan, path, threads=2, chunk=4096)
    assert all(m.holder[m.key] is before[id(m.holder)][m.key] for m in plan)  # nothing replaced


def test_tied_weights_are_read_and_copied_once(tmp_path):
    """A tensor saved under two names is one storage in the file: one copy on the device, as in memory."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = tmp_path / "tied.pt"
    torch.save({"model": model.state_dict()}, path)
    states = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    plan = upload.moves({"model": model}, states, wanted=_cpu)
    assert {m.key for m in plan} == {"emb.weight", "head.weight"}
    moved = upload.upload(plan, path, threads=2, chunk=4096)
    assert moved == emb.weight.numel() * emb.weight.element_size()  # read once
    saved = states["model"]
    assert saved["emb.weight"] is saved["head.weight"] and torch.equal(saved["emb.weight"], emb.weight)


def test_once_a_piece_fails_the_rest_is_not_read(saved, monkeypatch):
    model, opt, path, states = saved
    plan = upload.moves({"model": model, "optimizer": opt}, states, wanted=_cpu)
    calls = []

    def failing(*args):
        calls.append(args)
        raise OSError("disk gone")

    monkeypatch.setattr(upload, "_pread_into", failing)
    with pytest.raises(OSError, match="disk gone"):
        upload.upload(plan, path, threads=1, chunk=4096)
    assert len(calls) == 1  # not one read per remaining piece, each failing in turn
