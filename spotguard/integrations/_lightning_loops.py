"""Where Lightning's loops are after a resume: whether a validation follows the batch now ending, a
fresh iterator for an epoch Lightning resumes from an ended one's state, and the point where the
resumed train loaders get their states, which the resume checks first (``lightning.SpotguardCallback``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def validation_due(trainer: Any) -> bool:
    """Whether Lightning validates right after the batch now ending, as an uninterrupted run would.

    Asked at the batch's end, before a stop's ``trainer.should_stop`` counts: Lightning would also
    validate for that (an early stop), which a run that is not stopped does not do."""
    fit_loop = getattr(trainer, "fit_loop", None)
    loop = getattr(fit_loop, "epoch_loop", None)
    check = getattr(loop, "_should_check_val_fx", None)
    if check is None or trainer.sanity_checking:
        return False
    should_stop = trainer.should_stop
    try:
        trainer.should_stop = False
        return bool(check(getattr(fit_loop, "_data_fetcher", None)))
    except Exception as e:  # a private API of Lightning: a change there must not end the training
        logger.debug("cannot tell whether a validation follows this step: %s", e)
        return False
    finally:
        trainer.should_stop = should_stop


def begin_the_next_epoch(trainer: Any) -> None:
    """Give a resumed fit a fresh iterator where Lightning starts an epoch from an ended one's state.

    A checkpoint of an epoch's last batch resumes into the next epoch (Lightning counts the epoch
    done) without a new iterator: it goes on with the one made from the checkpoint's loader state,
    which has nothing left. With a ``DistributedSampler`` (torchdata's stateful one) that iterator is
    empty, so the whole next epoch was skipped (a 2-rank run trained epoch 2's order at step 17).
    Here such a sampler is set to the epoch being resumed and the loader iterated afresh, as the
    uninterrupted run did at that epoch's start (one draw of the loader's base seed included)."""
    fit = getattr(trainer, "fit_loop", None)
    loaders = getattr(getattr(fit, "_combined_loader", None), "flattened", None) or []
    ended: list[Any] = [s for s in (getattr(loader, "sampler", None) for loader in loaders) if _at_its_end(s)]
    fetcher = getattr(fit, "_data_fetcher", None)
    if not ended or fetcher is None:
        return
    for sampler in ended:
        sampler.next_yielded = None  # the checkpoint's position: the epoch it was for is over
        sampler.set_epoch(trainer.current_epoch)
    iter(fetcher)
    logger.debug("resumed at an epoch's end: epoch %d iterated afresh", trainer.current_epoch)


def _at_its_end(sampler: Any) -> bool:
    """A (torchdata stateful) ``DistributedSampler`` whose position, loaded (``next_yielded``, applied at
    its next iteration) or current, is the end of its epoch."""
    if not isinstance(sampler, DistributedSampler):
        return False
    position = getattr(sampler, "next_yielded", None)
    if position is None:
        position = getattr(sampler, "yielded", None)
    return isinstance(position, int) and position >= len(sampler)


def train_loaders(trainer: Any) -> dict[str, Any]:
    """The fit's train loaders whose state Lightning saves, by their index in its list of states."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    loaders = [dl for dl in getattr(combined, "flattened", None) or [] if _stateful(dl)]
    return {str(i): dl for i, dl in enumerate(loaders)}


def _stateful(obj: Any) -> bool:  # as Lightning's ``_Stateful``: what ``CombinedLoader._state_dicts`` saves
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def check_loader_states(trainer: Any, check: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Call ``check(loaders, states)`` where a resumed fit gives its train loaders their saved states
    (``fit_loop._load_combined_loader_states``, once the loaders exist), before it does; the states as
    ``check`` left them (moved to another worker count) are loaded. Lightning alone hands a state of
    another worker count to torchdata, which fails at the first batch, and one of another batch size
    without a word."""
    fit: Any = getattr(trainer, "fit_loop", None)
    load = getattr(fit, "_load_combined_loader_states", None)
    if load is None or not hasattr(fit, "_combined_loader_states_to_load"):
        logger.warning("Lightning's train loader states are not where expected: a resume does not check the loaders")
        return
    if getattr(fit, "_spotguard_checked", False):
        return

    def checked_load() -> Any:
        saved = fit._combined_loader_states_to_load
        if fit.restarting and saved and fit._combined_loader is not None:
            states = {str(i): state for i, state in enumerate(saved)}
            check(train_loaders(trainer), states)
            fit._combined_loader_states_to_load = [states[str(i)] for i in range(len(saved))]
        return load()

    fit._load_combined_loader_states = checked_load
    fit._spotguard_checked = True
