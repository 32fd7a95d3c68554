"""Augmentations drawn inside a StatefulDataLoader's workers resume exactly with ``WorkerRNG``, and not without.

A loader of 2 workers over a dataset that draws from torch, ``random`` and NumPy in ``__getitem__``, saved
mid-epoch and resumed by a fresh loader and Guard, then run across the next epoch: every later batch
equals the uninterrupted run's.
"""

from __future__ import annotations

import copy
import logging
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard
from spotguard import WorkerRNG

from .test_data import loader as shuffled

pytestmark = pytest.mark.timeout(180)

SIZE, BATCH = 16, 2  # 8 batches an epoch


class Augmented(Dataset):
    """Each sample: its index, then a draw from each of the three streams (an augmentation's)."""

    classes = ("a", "b")

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item(), random.random(), float(np.random.rand())])


def loader(workers: int, wrap: bool, persistent: bool = False) -> StatefulDataLoader:
    """A fresh loader; the global streams seeded too (``num_workers=0`` draws from them)."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    dataset = WorkerRNG(Augmented()) if wrap else Augmented()
    return shuffled(workers, BATCH, dataset, seed=5, persistent_workers=persistent)


def batches(ld: StatefulDataLoader, epochs: int) -> list[torch.Tensor]:
    return [b for _ in range(epochs) for b in ld]


def stopped_then_resumed(
    tmp_path, stop: int, workers: int, wrap: bool, after: int | None = None, persistent: bool = False
) -> list[torch.Tensor]:
    """The batches after ``stop``: saved there (mid-epoch), resumed by a fresh loader (``after`` workers)."""
    first = loader(workers, wrap, persistent)
    guard = spotguard.Guard(str(tmp_path), providers=[], lease_ttl=None).track(loader=first)
    it = iter(first)
    for _ in range(stop):
        next(it)
    guard.save(stop)
    guard.close(save=False)
    for _ in it:  # to the epoch's end, where its workers end (dropped mid-epoch, their end took 10 s)
        pass
    new = loader(workers if after is None else after, wrap, persistent)
    guard = spotguard.Guard(str(tmp_path), providers=[], lease_ttl=None).track(loader=new)
    guard.resume()
    rest = batches(new, 2)  # the rest of this epoch, and the next one
    guard.close(save=False)
    return rest


@pytest.mark.parametrize(("workers", "persistent"), [(2, False), (2, True), (0, False)])
def test_worker_draws_resume_exactly_across_the_next_epoch(tmp_path, workers, persistent):
    reference = batches(loader(workers, True, persistent), 3)
    rest = stopped_then_resumed(tmp_path, 5, workers, wrap=True, persistent=persistent)
    assert len(rest) == len(reference) - 5 - 8
    for got, want in zip(rest, reference[5:], strict=False):
        assert torch.equal(got, want), (got, want)


def test_without_it_the_worker_draws_start_over(tmp_path):
    # The gap WorkerRNG closes: the same samples in the same order, other augmentations.
    reference = batches(loader(2, wrap=False), 3)
    rest = stopped_then_resumed(tmp_path, 5, 2, wrap=False)
    assert all(torch.equal(got[:, 0], want[:, 0]) for got, want in zip(rest, reference[5:], strict=False))
    assert not torch.equal(rest[0], reference[5])


def test_another_worker_count_continues_at_the_same_sample_with_fresh_streams(tmp_path, caplog):
    reference = batches(loader(2, wrap=True), 3)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        rest = stopped_then_resumed(tmp_path, 5, 2, wrap=True, after=1)
    assert "saved with num_workers=2 and has num_workers=1 now: it continues at the same sample" in caplog.text
    assert [int(i) for b in rest[:3] for i in b[:, 0]] == [int(i) for b in reference[5:8] for i in b[:, 0]]


class Counted(IterableDataset):
    """An iterable dataset that shards itself in each worker by ``start``/``end``, and keeps a state."""

    def __init__(self, end: int = 6) -> None:
        self.start, self.end, self.seen = 0, end, 0

    def __iter__(self):
        yield from range(self.start, self.end)

    def __len__(self) -> int:
        return self.end - self.start

    def __deepcopy__(self, memo: dict) -> Counted:  # a dataset's own: the wrapper must not hand its copy back
        copied = Counted(self.end)
        copied.start, copied.seen = self.start, self.seen
        return copied

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def test_the_wrapper_is_the_dataset_to_its_users():
    wrapped = WorkerRNG(Counted())
    assert isinstance(wrapped, IterableDataset) and isinstance(wrapped, WorkerRNG) and WorkerRNG(wrapped) is wrapped
    wrapped.start = 3  # as a worker_init_fn shards it through get_worker_info().dataset
    assert wrapped.dataset.start == 3 and list(wrapped) == [3, 4, 5] and len(wrapped) == 3
    state = wrapped.state_dict()
    assert state["dataset"] == {"seen": 0} and state["streams"] is None  # the main process: the Guard's streams
    wrapped.load_state_dict({**state, "dataset": {"seen": 7}})
    assert wrapped.dataset.seen == 7
    for copied in (pickle.loads(pickle.dumps(wrapped)), copy.deepcopy(wrapped)):  # to a spawned worker, a deepcopy
        assert isinstance(copied, WorkerRNG) and list(copied) == [3, 4, 5] and copied.dataset is not wrapped.dataset
    mapped = WorkerRNG(Augmented())
    assert len(mapped) == SIZE and mapped.classes == ("a", "b") and not isinstance(mapped, IterableDataset)


def test_an_iterable_dataset_without_a_state_is_left_to_torchdata_s_replay():
    # A state of ours would stop torchdata from replaying it: resumed, it would start over.
    stream = IterableDataset.__new__(type("Plain", (IterableDataset,), {"__iter__": lambda self: iter(range(6))}))
    assert WorkerRNG(stream) is stream
    ld = StatefulDataLoader(WorkerRNG(stream), batch_size=1)
    it = iter(ld)
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    state = ld.state_dict()
    new = StatefulDataLoader(WorkerRNG(stream), batch_size=1)
    new.load_state_dict(state)
    assert [int(b) for b in new] == [3, 4, 5]
