"""The example's training function with an emergency save that outlasts a short drain deadline.

``SLOW_S`` seconds pass inside the emergency save before it writes (as a state too large for the
deadline takes): Ray Train ends the attempt at its deadline meanwhile, and the restart resumes from
the last checkpoint that did commit. Used by tests/workers/ray_cluster.py ``--slow-emergency``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import train_ray

ENV = "SPOTGUARD_TEST_SLOW_EMERGENCY_S"


def train_loop_per_worker(config: dict) -> None:
    from spotguard.guard.saves import Saves

    seconds, original = float(os.environ.get(ENV, "0")), Saves.save

    def save(self: Saves, step: int, reason: str, *args: Any, **kwargs: Any) -> Any:
        if reason == "emergency":
            time.sleep(seconds)
        return original(self, step, reason, *args, **kwargs)

    Saves.save = save  # type: ignore[method-assign]
    train_ray.train_loop_per_worker(config)
