"""Data position: make a resumed loader continue exactly, the main process's random streams included
(draws inside worker processes: ``worker_rng.WorkerRNG``, docs/training-loop.md).

torchdata's ``StatefulDataLoader`` restores which batches are left. One gap remains that we close
here: creating an iterator draws a base seed from the loader's ``generator`` or, without one, from
the global torch RNG. The resumed run creates an iterator at a point where the uninterrupted run
did not (mid-epoch), so every later random number (dropout, the next epoch's seed) would shift.
After a restore, the loader's first iterator is therefore created without a trace on any stream.

A restore is also checked against what changed in the loader (``check_loaders``, before anything is
restored): another ``num_workers`` is moved to the new count where that is well defined
(``workers``) and refused otherwise (torchdata would fail with a bare ``AssertionError`` at the
first batch of every restart); another batch size is refused or accepted (``Rebatch``).
"""

from __future__ import annotations

import enum
import logging
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from spotguard.checkpoint.state.state import rng_isolated
from spotguard.checkpoint.state.workers import convert as convert_workers
from spotguard.errors import CheckpointMismatchError

logger = logging.getLogger(__name__)


def is_stateful_loader(obj: Any) -> bool:
    """A DataLoader that can save its position (torchdata's StatefulDataLoader or alike)."""
    return (
        isinstance(obj, DataLoader)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


#: What an Accelerate user must add: ``prepare()`` turns any loader into a plain one without it.
ACCELERATE_HINT = (
    " With Accelerate, also pass Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)):"
    " without it prepare() makes a plain DataLoader of a StatefulDataLoader too."
)


def warn_if_plain_loader(name: str, obj: Any, hint: str = "") -> bool:
    """Warn about a plain DataLoader (a ``UserWarning``, shown once per call site); True when ``obj`` is one."""
    if isinstance(obj, DataLoader) and not is_stateful_loader(obj):
        msg = (
            f"spotguard: {name!r} is a plain torch DataLoader; its position cannot be saved, so a resumed "
            "run restarts its epoch from the beginning. Use torchdata.stateful_dataloader."
            "StatefulDataLoader (pip install 'spotguard[data]') for an exact resume." + hint
        )
        warnings.warn(msg, UserWarning, stacklevel=3)  # one channel only: not logged as well
        return True
    return False


def generator_state(loader: Any) -> torch.Tensor | None:
    gen = getattr(loader, "generator", None)
    return gen.get_state() if isinstance(gen, torch.Generator) else None


def restore_generator(loader: Any, state: torch.Tensor | None) -> None:
    gen = getattr(loader, "generator", None)
    if state is not None and isinstance(gen, torch.Generator):
        gen.set_state(state)


def neutralize_next_iterator(loader: Any) -> None:
    """Make the loader's next iterator creation leave every random stream untouched (once).

    The patches here hold the loader weakly: a loader that holds a function holding it is a cycle, and
    the cyclic collector closes its worker queues before its iterator shuts the workers down (5 s each,
    ``spotguard.weakcall``)."""
    if getattr(loader, "_get_iterator", None) is None:
        logger.debug("%s has no _get_iterator; resumed random streams may shift", type(loader).__name__)
        return
    ref = weakref.ref(loader)

    def get_iterator_once() -> Any:
        owner = ref()  # called through the loader: alive
        assert owner is not None
        del owner._get_iterator  # back to the class method for every later epoch
        gen_state = generator_state(owner)
        with rng_isolated():
            try:
                first = owner._get_iterator()
            finally:
                restore_generator(owner, gen_state)
        _watch_dropped(owner, first)
        return first

    loader._get_iterator = get_iterator_once


def _watch_dropped(loader: Any, first: Any) -> None:
    """Warn once when the iterator made next, while ``first`` (it carries the restored position) has not
    ended and yielded at most one batch: the position went with it, and the epoch starts over. That is a
    ``next(iter(loader))`` peek (PyTorch's DDP tutorial reads its batch size so), silently inexact. A
    loader with persistent workers makes no new iterator: it resets ``first``, which is watched then."""
    start, name = getattr(first, "_num_yielded", 0), type(loader).__name__
    ref = weakref.ref(loader)

    def warn_if_dropped(it: Any) -> None:
        if not getattr(it, "_finished", True) and getattr(it, "_num_yielded", start) - start <= 1:
            logger.warning(
                "%s: its first iterator after the resume, which carries the restored position, was dropped "
                "after %d batch(es) and a new one starts the epoch over: this run now differs from an "
                "uninterrupted one. A throwaway next(iter(loader)) (to read a batch size) does this: read "
                "loader.batch_size instead",
                name,
                getattr(it, "_num_yielded", start) - start,
            )

    def get_iterator_watched() -> Any:
        owner = ref()
        assert owner is not None
        del owner._get_iterator
        warn_if_dropped(first)
        return owner._get_iterator()

    loader._get_iterator = get_iterator_watched
    if (
        getattr(loader, "persistent_workers", False)
        and getattr(loader, "num_workers", 0) > 0
        and hasattr(first, "_reset")
    ):
        it_ref = weakref.ref(first)  # held weakly: the function is stored on `first` itself

        def reset_watched(*args: Any, **kwargs: Any) -> Any:
            it = it_ref()  # called through it: alive
            assert it is not None
            del it._reset
            warn_if_dropped(it)
            return it._reset(*args, **kwargs)

        first._reset = reset_watched


def as_at_last_batch(objects: Mapping[str, Any], states: MutableMapping[str, Any]) -> None:
    """Rewrite each stateful loader's state in ``states`` from "epoch ended" to "last batch yielded".

    The two differ only in ``_iterator_finished``, and a resume from an ended epoch starts a new one
    at once: a stop between the loader's last batch and the next epoch (an evaluation) would train one
    epoch too many. As at its last batch, the resumed loader yields nothing for that epoch, so the
    loop's end-of-epoch code (the cut evaluation) runs again, then the next epoch starts as it would have.
    """
    for name, obj in objects.items():
        state = states.get(name)
        if is_stateful_loader(obj) and isinstance(state, Mapping) and state.get("_iterator_finished") is True:
            states[name] = {**state, "_iterator_finished": False}


class Rebatch(str, enum.Enum):
    """What a resume does with a tracked loader saved with another batch size than it has now."""

    REFUSE = "refuse"  # raise, naming both sizes: the same step would mean another number of samples
    ACCEPT = "accept"  # continue at the same sample, in batches of the new size (a warning says so)


def loader_facts(objects: Mapping[str, Any]) -> dict[str, dict[str, int | None]]:
    """What a resume compares, per stateful loader: its ``num_workers`` and batch size, as saved."""
    return {
        name: {"num_workers": int(obj.num_workers), "batch_size": _batch_size(obj)}
        for name, obj in objects.items()
        if is_stateful_loader(obj)
    }


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    if size is None:  # a batch_sampler of its own: its size, when it has one
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def saved_workers(state: Any) -> int | None:
    """The ``num_workers`` a ``StatefulDataLoader`` state was saved with (None: not such a state)."""
    if not isinstance(state, Mapping):
        return None
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):  # the multi-process loader's layout
        main = snapshot.get("_main_snapshot")
        if isinstance(main, Mapping) and isinstance(main.get("_num_workers"), int):
            return int(main["_num_workers"])
        workers = snapshot.get("_worker_snapshots")
        return len(workers) if isinstance(workers, Mapping) else None
    return 0 if "_num_yielded" in state else None  # the single-process layout


def check_loaders(
    objects: Mapping[str, Any],
    states: MutableMapping[str, Any],
    facts: Mapping[str, Mapping[str, Any]],
    where: str,
    rebatch: Rebatch | str = Rebatch.REFUSE,
) -> None:
    """Refuse (``CheckpointMismatchError``) a tracked loader that changed in a way its saved state cannot follow.

    Call before anything is restored. A state saved with another ``num_workers`` is rewritten in
    ``states`` for the new count where that is well defined (``workers.convert``), with a warning. ``facts``: ``loader_facts()`` as saved (empty for checkpoints
    older than it: the worker count is then read from the state's layout, the batch size not checked).
    """
    for name, obj in objects.items():
        if not is_stateful_loader(obj) or name not in states:
            continue
        saved = facts.get(name, {})
        workers = saved.get("num_workers", saved_workers(states[name]))
        if isinstance(workers, int) and workers != obj.num_workers:
            moved, why = convert_workers(states[name], obj.num_workers)
            if moved is None:
                raise CheckpointMismatchError(
                    f"{where}: data loader {name!r} was saved with num_workers={workers} and has num_workers="
                    f"{obj.num_workers} now; its position cannot be moved to another number of workers: {why} "
                    f"(torchdata would fail at the first batch). Resume with num_workers={workers}, or change "
                    "the count only in a run that starts fresh"
                )
            states[name] = moved
            zero = (workers == 0) != (obj.num_workers == 0)  # a loader with workers seeds them from its generator
            logger.warning(
                "%s: data loader %r was saved with num_workers=%d and has num_workers=%d now: it continues at "
                "the same sample; random draws inside its workers (augmentations) come from other streams than "
                "an uninterrupted run's%s",
                where,
                name,
                workers,
                obj.num_workers,
                "; from the next epoch on it also shuffles otherwise" if zero else "",
            )
        check_batch_size(where, name, saved.get("batch_size"), _batch_size(obj), rebatch)


def check_batch_size(
    where: str, name: str, size: Any, now: Any, rebatch: Rebatch | str, accepted: str | None = None
) -> None:
    """Refuse (``CheckpointMismatchError``) a loader saved with batch size ``size`` that has ``now``, or warn
    (``rebatch="accept"``); nothing when either is unknown. ``accepted``: what the resume then does (default:
    the loader continues at the same sample, as a ``StatefulDataLoader`` does)."""
    if not isinstance(size, int) or not isinstance(now, int) or size == now:
        return
    accepted = accepted or f"it continues at the same sample, in batches of {now}"
    if Rebatch(rebatch) is Rebatch.REFUSE:
        raise CheckpointMismatchError(
            f"{where}: data loader {name!r} was saved with batch_size={size} and has batch_size={now} now: "
            "step counts (schedules, every_steps, epoch length) would mean another number of samples. "
            f"Resume with batch_size={size}, or pass rebatch='accept' (to Guard or the trainer's integration): "
            f"{accepted}"
        )
    logger.warning(
        "%s: data loader %r was saved with batch_size=%d and has batch_size=%d now (rebatch='accept'): %s; a step "
        "now holds another number of samples",
        where,
        name,
        size,
        now,
        accepted,
    )
