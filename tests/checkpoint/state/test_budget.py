"""The staging budget: what a snapshot of a state holds, and the default share of a node's memory."""

from __future__ import annotations

import torch

from spotguard.checkpoint.state import budget


class DTensor(torch.Tensor):
    """Named as torch's: what the budget sees of an FSDP2/TP shard (the global shape, a local part)."""


def sharded(global_numel: int, local_numel: int) -> torch.Tensor:
    t = torch.Tensor._make_subclass(DTensor, torch.zeros(global_numel))
    t._local_tensor = torch.zeros(local_numel)  # type: ignore[attr-defined]
    return t


def test_a_shard_counts_its_local_part_not_the_global_tensor():
    state = {"w": sharded(1024, 256), "b": torch.zeros(10), "meta": [torch.zeros(2, dtype=torch.float64), "x"]}
    assert budget.tensor_bytes(state) == 256 * 4 + 10 * 4 + 2 * 8


def test_the_default_budget_is_shared_by_the_nodes_ranks(monkeypatch):
    monkeypatch.setattr(budget, "available_memory", lambda: 64 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert budget.default_budget() == 32 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert budget.default_budget() == 4 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")  # a launcher's variable: not ours to refuse
    assert budget.default_budget() == 32 << 30
