"""Data position: make a resumed loader continue exactly, random streams included.

torchdata's ``StatefulDataLoader`` restores which batches are left. One gap remains that we close
here: creating an iterator draws a base seed from the loader's ``generator`` or, without one, from
the global torch RNG. The resumed run creates an iterator at a point where the uninterrupted run
did not (mid-epoch), so every later random number (dropout, the next epoch's seed) would shift.
After a restore, the loader's first iterator is therefore created without a trace on any stream.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader

from spotguard.checkpoint.state import rng_isolated

logger = logging.getLogger(__name__)


def is_stateful_loader(obj: Any) -> bool:
    """A DataLoader that can save its position (torchdata's StatefulDataLoader or alike)."""
    return (
        isinstance(obj, DataLoader)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def warn_if_plain_loader(name: str, obj: Any) -> bool:
    """Warn about a plain DataLoader (a ``UserWarning``, shown once per call site); True when ``obj`` is one."""
    if isinstance(obj, DataLoader) and not is_stateful_loader(obj):
        msg = (
            f"spotguard: {name!r} is a plain torch DataLoader; its position cannot be saved, so a resumed "
            "run restarts its epoch from the beginning. Use torchdata.stateful_dataloader."
            "StatefulDataLoader (pip install 'spotguard[data]') for an exact resume."
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
    """Make the loader's next iterator creation leave every random stream untouched (once)."""
    original = getattr(loader, "_get_iterator", None)
    if original is None:
        logger.debug("%s has no _get_iterator; resumed random streams may shift", type(loader).__name__)
        return

    def get_iterator_once() -> Any:
        del loader._get_iterator  # back to the class method for every later epoch
        gen_state = generator_state(loader)
        with rng_isolated():
            try:
                return original()
            finally:
                restore_generator(loader, gen_state)

    loader._get_iterator = get_iterator_once
