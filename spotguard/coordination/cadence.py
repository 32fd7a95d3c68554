"""Where the periodic saves land, the same for the ``Guard``'s schedule and every trainer integration."""

from __future__ import annotations

import math


def next_multiple(step: int, every: int | None) -> float:
    """The first multiple of ``every`` after ``step`` (inf without ``every``).

    Periodic saves land on multiples of N, as Hugging Face's ``save_steps`` do, whatever came between:
    a resume at step 4826 (an emergency checkpoint) or an advisory save is followed by 5000, not 5826.
    """
    return (step // every + 1) * every if every else math.inf
