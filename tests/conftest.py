"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import read_losses, run_example


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted example runs, computed once per configuration: {key: (losses, final_path)}."""
    cache: dict[tuple[str, ...], tuple[list[tuple[int, float]], Path]] = {}

    def get(*args: str) -> tuple[list[tuple[int, float]], Path]:
        if args not in cache:
            d = tmp_path_factory.mktemp("reference")
            losses, final = d / "losses.jsonl", d / "final.pt"
            proc = run_example(d / "ckpt", *args, "--losses", str(losses), "--final", str(final))
            assert proc.returncode == 0, proc.stderr
            cache[args] = (read_losses(losses), final)
        return cache[args]

    return get
