"""A ``StatefulDataLoader`` position moved to another number of workers, where that is well defined.

torchdata keeps two layouts: one process (``num_workers=0``: the sampler's position and the count of
batches yielded) and several (a snapshot of the main process's sampler position, plus one state
per worker). Loading one into a loader of another worker count fails at the first batch with a bare
``AssertionError``. For a map-style dataset whose workers keep no state of their own, the position
is the sampler's alone: ``convert`` rewrites it into the other layout, and the loader continues at
the very sample it stopped at. What changes: random draws inside the workers (augmentations) come
from streams seeded for the new worker count, not the uninterrupted run's. An iterable dataset, a
dataset with state, or a snapshot older than the last batch cannot be moved: ``convert`` says why
(``WorkerRNG``'s saved streams do not hold it back: the workers' streams start afresh).

Order of use: ``data.check_loaders`` calls ``convert`` before anything is restored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from spotguard.checkpoint.state.worker_rng import is_streams_only

#: The main process's part of the position, the same in both layouts.
_MAIN = (
    "_sampler_iter_state",
    "_index_sampler_state",
    "_sampler_iter_yielded",
    "_IterableDataset_len_called",
    "_shared_seed",
)


def convert(state: Mapping[str, Any], workers: int) -> tuple[dict[str, Any] | None, str]:
    """(``state`` in the layout of a loader with ``workers`` workers, "") or (None, why it cannot be)."""
    found = _position(state)
    if isinstance(found, str):
        return None, found
    main, yielded, base_seed, finished = found
    if workers == 0:
        single = {**main, "_num_yielded": yielded, "fetcher_state": None, "dataset_state": None}
        return {**single, "_iterator_finished": finished}, ""
    if base_seed is None:  # from one process: the workers' streams get a seed of their own, the same on every resume
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(yielded)))
    snapshot = {
        "_snapshot_step": yielded,
        "_last_yielded_worker_id": workers - 1,  # the next batch is worker 0's
        "_main_snapshot": {**main, "_num_workers": workers, "_base_seed": base_seed},
        "_worker_snapshots": {
            f"worker_{i}": {"worker_id": i, "dataset_state": None, "fetcher_state": None} for i in range(workers)
        },
    }
    return {"_snapshot": snapshot, "_steps_since_snapshot": 0, "_iterator_finished": finished}, ""


def _position(state: Mapping[str, Any]) -> tuple[dict[str, Any], int, int | None, bool] | str:
    """(main part, batches yielded, workers' base seed, finished) of either layout, or why it is not movable."""
    finished = bool(state.get("_iterator_finished", False))
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        main, per_worker = snapshot.get("_main_snapshot"), snapshot.get("_worker_snapshots")
        if not isinstance(main, Mapping) or not isinstance(per_worker, Mapping) or not set(_MAIN) <= set(main):
            return "its state is not in a layout this spotguard knows"
        if state.get("_steps_since_snapshot", 0):
            return "its last snapshot is older than its last batch (snapshot_every_n_steps > 1)"
        if any(
            not isinstance(w, Mapping) or _kept(w.get("dataset_state")) or w.get("fetcher_state") is not None
            for w in per_worker.values()
        ):
            return "its dataset keeps a state in each worker (an iterable or stateful dataset)"
        seed = main.get("_base_seed")
        return {k: main[k] for k in _MAIN}, int(snapshot.get("_snapshot_step", 0)), seed, finished
    if "_num_yielded" in state and set(_MAIN) <= set(state):
        if _kept(state.get("dataset_state")) or state.get("fetcher_state") is not None:
            return "its dataset keeps a state of its own (an iterable or stateful dataset)"
        return {k: state[k] for k in _MAIN}, int(state["_num_yielded"]), None, finished
    return "its state is not in a layout this spotguard knows"


def _kept(dataset_state: Any) -> bool:
    """A dataset's own state in a snapshot (``WorkerRNG``'s random streams alone are not one: they start afresh)."""
    return dataset_state is not None and not is_streams_only(dataset_state)
