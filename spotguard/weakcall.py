"""Callbacks that do not keep their owner alive.

Why: an owner (``Guard``, an integration's loop) holds its watcher and its checkpoint engine; a
callback of theirs holding the owner back makes a cycle, so a dropped owner waits for the cyclic
garbage collector. That collector closes a tracked DataLoader's worker queues before the loader's
iterator shuts its workers down, and PyTorch then waits out its 5 s join timeout for each live
worker (10 s for two, in the middle of the next step that triggers a collection). Without a cycle,
the owner and what it tracks go the moment its last reference does, and the workers end at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., None]:
    """``method``, a bound method, as a callback that holds its object weakly: once the object is
    gone, a call does nothing."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call
