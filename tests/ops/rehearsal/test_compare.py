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


def test_a_lightning_checkpoint_is_compared_value_by_value(tmp_path):
    """Lightning's ``lightning.ckpt`` (a torch.save of nested dicts, its loops' counters among them) was left out:
    a run whose logger step was one ahead of the reference's compared as exact, over no value at all."""
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name, counter in (("run", 70), ("reference", 69)):
        folder = tmp_path / f"{name}-folder"
        folder.mkdir()
        state = {"state_dict": {"w": torch.ones(2)}, "loops": {"fit_loop": {"_batches_that_stepped": counter}}}
        torch.save(state, folder / "lightning.ckpt")
        checkpoint.write_dir(open_storage(str(tmp_path / name)), 70, folder, reason="final")
    result = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert not result.exact and result.compared == 2, result.line()
    assert result.differences == ["lightning.ckpt.loops.fit_loop._batches_that_stepped: 70 vs 69"]


def test_dcp_shards_are_named_as_not_compared_and_nothing_read_is_not_exact(tmp_path):
    """A sharded save's model and optimizer are in ``*.distcp`` shards, which are not read here: a report of
    its per-rank files alone said "exact: yes" and named nothing it left out."""
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    for name in ("run", "reference"):
        for with_rank_file in (True, False):
            folder = tmp_path / f"{name}-{with_rank_file}"
            (folder / "shards").mkdir(parents=True)
            (folder / "shards" / "rank-00000.distcp").write_bytes(name.encode())  # differ: not read
            if with_rank_file:
                torch.save({"rng": torch.ones(2)}, folder / "rank-00000.pt")
            storage = open_storage(str(tmp_path / f"{with_rank_file}" / name))
            checkpoint.write_dir(storage, 3, folder, reason="final")
    some = compare(str(tmp_path / "True" / "run"), str(tmp_path / "True" / "reference"))
    assert some.exact and some.compared == 1 and "not compared: 1 DCP shard file(s)" in some.line(), some.line()
    none = compare(str(tmp_path / "False" / "run"), str(tmp_path / "False" / "reference"))
    assert not none.exact and none.compared == 0 and "no value compared" in none.line(), none.line()
