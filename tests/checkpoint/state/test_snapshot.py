"""Staging: snapshots into reused host buffers copy values exactly, whatever the state's shape."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from spotguard.checkpoint.state.snapshot import Staging

Pair = namedtuple("Pair", "a b")


def test_snapshot_copies_every_tensor_and_keeps_the_structure():
    w = torch.nn.Parameter(torch.randn(3, 4))
    state = OrderedDict(
        w=w,
        nested={"list": [torch.arange(5), 7, "x"], "pair": Pair(torch.ones(2), None)},
        step=torch.tensor(3),
        meta={"lr": 0.1},
    )
    snap = Staging(pin=False).snapshot(state)
    assert type(snap) is OrderedDict and isinstance(snap["nested"]["pair"], Pair)
    assert torch.equal(snap["w"], w) and not snap["w"].requires_grad and snap["w"].grad_fn is None
    assert torch.equal(snap["nested"]["list"][0], torch.arange(5)) and snap["nested"]["list"][1:] == [7, "x"]
    assert torch.equal(snap["nested"]["pair"].a, torch.ones(2)) and snap["nested"]["pair"].b is None
    assert snap["meta"] == {"lr": 0.1} and snap["meta"] is not state["meta"]
    with torch.no_grad():
        w.add_(1)  # training goes on: the snapshot keeps the values it copied
    assert not torch.equal(snap["w"], w)


def test_buffers_are_reused_resized_and_dropped_with_the_state():
    staging = Staging(pin=False)
    first = staging.snapshot({"a": torch.zeros(4), "b": torch.zeros(2, 2), "gone": torch.zeros(8)})
    assert staging.allocations == 3
    again = staging.snapshot({"a": torch.ones(4), "b": torch.ones(3, 3)})  # b changed shape, gone went
    assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], torch.ones(4))
    assert again["b"].shape == (3, 3) and torch.equal(again["b"], torch.ones(3, 3))
    assert staging.allocations == 4 and staging.nbytes == (4 + 9) * 4
    staging.snapshot({"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(3, 3)})  # dtype changed
    assert staging.allocations == 5


def test_many_small_tensors_and_views_are_copied_exactly():
    base = torch.randn(64, 64)
    state = {f"t{i}": torch.randn(i % 7 + 1) for i in range(500)}
    state["view"] = base[::2, 1:]  # not contiguous
    snap = Staging(pin=False).snapshot(state)
    assert all(torch.equal(snap[k], v) for k, v in state.items())
    assert snap["view"].untyped_storage().nbytes() == 32 * 63 * 4  # the view alone, not its base


def test_a_snapshot_is_canonical_so_the_same_state_gives_the_same_bytes():
    """The walk interns strings (keys, values, inside tuple keys) as ``canonical()`` would: equal
    states whose strings are different objects serialise to the same bytes without a second pass."""
    import io

    def saved(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    def state(make) -> dict:
        return {
            "state": {0: {make("exp_avg"): torch.ones(2)}, 1: {make("exp_avg"): torch.zeros(2)}},
            "groups": [{make("name"): make("exp_avg"), (make("k"), 1): Pair(make("exp_avg"), 2)}],
        }

    shared, apart = state(lambda s: s), state(lambda s: "".join(list(s)))
    assert saved(shared) != saved(apart)  # what pickle's memo does to equal strings made apart
    staging = Staging(pin=False)
    assert saved(staging.snapshot(shared)) == saved(staging.snapshot(apart))


def test_nbytes_follows_the_buffers():
    staging = Staging(pin=False)
    staging.snapshot({"a": torch.zeros(4), "b": torch.zeros(2, 2, dtype=torch.float64)})
    assert staging.nbytes == 4 * 4 + 4 * 8
    staging.snapshot({"a": torch.zeros(4)})
    assert staging.nbytes == 4 * 4
    staging.snapshot({"a": torch.zeros(4, dtype=torch.int8), "c": torch.zeros(3)})
    assert staging.nbytes == 4 + 3 * 4
