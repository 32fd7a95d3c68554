"""``rehearse --reference``'s comparison of two final checkpoints (``ops.rehearsal.compare``), on real Guard saves."""

from __future__ import annotations

import random

import numpy as np
import torch

import spotguard
from spotguard.ops.rehearsal.compare import SHOWN, compare


def _final(storage: str, seed: int) -> None:
    """A run of 2 steps whose weights are seeded alike and whose Python and NumPy streams are seeded by ``seed``."""
    torch.manual_seed(0)
    random.seed(seed)
    np.random.seed(seed)
    guard = spotguard.Guard(storage, providers=[])
    guard.track(model=torch.nn.Linear(4, 2))
    guard.resume()
    with guard:
        for step in (1, 2):
            guard.step(step)


def test_streams_the_job_never_seeds_are_named_first_with_the_hint(tmp_path):
    """nanoGPT seeds torch only: the Python and NumPy streams differ in many places, and the hint to seed them,
    which came last, was cut off the report (it names the first few differences)."""
    _final(str(tmp_path / "run"), seed=1)
    _final(str(tmp_path / "reference"), seed=2)
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.exact and len(result.differences) > SHOWN, result.differences
    assert "seed it" in result.line() and "seed it" in result.hint, result.line()
    assert all(".rng." in d for d in result.differences)  # the hint is not one of them (the JSON report's list)
    assert compare(str(tmp_path / "run"), str(tmp_path / "run")).exact  # the same checkpoint: exact
