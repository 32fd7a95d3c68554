"""Random draws inside a ``StatefulDataLoader``'s worker processes, resumed exactly.

torchdata saves each worker's position but not its random streams: on a resume it seeds every
worker afresh (``base_seed + worker_id``), so an augmentation that draws from ``torch``, ``random``
or NumPy in ``__getitem__`` starts its stream over where the uninterrupted run's went on, and every
later loss differs. ``WorkerRNG`` wraps the dataset: torchdata asks a dataset with ``state_dict`` for
its state after each batch a worker makes, and hands it back to the worker's dataset (after the
seeding) on a resume. Here that state is the worker's three streams, and the wrapped dataset's own
state where it has one. In the main process (``num_workers=0``) there is nothing to add: the Guard
saves and restores the global streams itself.
"""

from __future__ import annotations

import copy
import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

#: Marks a ``WorkerRNG`` state in a loader's worker snapshot (``workers.convert`` tells it from a dataset's).
KEY = "spotguard_worker_rng"


def _streams() -> dict[str, Any]:
    """This process's random streams, as lists and tensors (a checkpoint loads with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": [version, list(internal), gauss]}
    np = sys.modules.get("numpy")  # only if this program uses NumPy: never imported here
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return out


def _restore(streams: dict[str, Any]) -> None:
    torch.set_rng_state(streams["torch"])
    version, internal, gauss = streams["random"]
    random.setstate((version, tuple(internal), gauss))
    saved = streams.get("numpy")
    if saved is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = saved
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class WorkerRNG(Dataset):
    """``dataset``, whose random draws in a ``StatefulDataLoader``'s workers resume exactly (module docstring).

    Use it as the loader's dataset: ``StatefulDataLoader(WorkerRNG(MyDataset()), num_workers=4, ...)``,
    tracked by the Guard as any loader. Attributes read and set go to the wrapped dataset (a
    ``worker_init_fn`` that shards through ``get_worker_info().dataset`` works as before; ``.dataset`` read
    is the wrapped dataset itself), as do ``len()``
    and its own ``state_dict``. An iterable dataset without a ``state_dict`` is returned as it is: torchdata
    resumes it by replaying its items, which a state of ours would stop (it would start over). A loader
    resumed with another ``num_workers`` starts the workers' streams afresh (with the warning it gives).
    """

    dataset: Any

    def __new__(cls, dataset: Any) -> Any:
        if isinstance(dataset, WorkerRNG) or (isinstance(dataset, IterableDataset) and not _stateful(dataset)):
            return dataset
        kind = _IterableWorkerRNG if isinstance(dataset, IterableDataset) else _MapWorkerRNG
        return super().__new__(kind if cls is WorkerRNG else cls)

    def __init__(self, dataset: Any) -> None:
        if dataset is not self:  # ``WorkerRNG(wrapped)`` is ``wrapped``
            object.__setattr__(self, "dataset", dataset)

    def __reduce__(self) -> tuple[Any, ...]:  # to worker processes (spawn, forkserver): built again around it
        return WorkerRNG, (self.dataset,)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # looked up on the instance: not the dataset's own
        return WorkerRNG(copy.deepcopy(self.dataset, memo))

    def __getattr__(self, name: str) -> Any:  # only what the wrapper lacks: the dataset's own attributes
        if name == "dataset":  # not set (yet): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        inner = self.dataset.state_dict() if _stateful(self.dataset) else None
        return {KEY: 1, "streams": _streams() if get_worker_info() is not None else None, "dataset": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset") is not None and _stateful(self.dataset):
            self.dataset.load_state_dict(state["dataset"])
        if state.get("streams") is not None and get_worker_info() is not None:
            _restore(state["streams"])  # last: nothing after it may draw before the next batch


class _MapWorkerRNG(WorkerRNG):
    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]


class _IterableWorkerRNG(WorkerRNG, IterableDataset):
    def __iter__(self) -> Any:
        return iter(self.dataset)


def is_streams_only(state: Any) -> bool:
    """A worker's dataset state that holds only ``WorkerRNG``'s streams (its dataset keeps none of its own)."""
    return isinstance(state, dict) and state.get(KEY) == 1 and state.get("dataset") is None
