"""A torchrun script we did not write (tests/workers/thirdparty_ddp.py: DDP on 2 gloo ranks, a
DistributedSampler under a StatefulDataLoader, gradient accumulation, OneCycleLR, clipping, dropout,
a rank-0 evaluation with its own generator) stopped with SIGTERM to torchrun, as a scheduler or the
kubelet does, and resumed by running the same command again.

Every rank's loss at every optimizer step, the evaluation losses and every rank's final weights and
optimizer state must equal an uninterrupted run's, bit for bit; the stopped job exits 1 (torchrun's
own exit: docs/distributed.md) with an emergency checkpoint of its stop step. The stop step is random:
rerun one with ``THIRDPARTY_DDP_SEED=<the printed seed>``.
"""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard.checkpoint import scan
from spotguard.storage import open_storage
from tests.forked import behind
from tests.helpers import WORKERS, after_step, assert_same, read_losses, run, signal_to, stop_when, torchrun

pytestmark = pytest.mark.slow

SCRIPT = WORKERS / "thirdparty_ddp.py"
RANKS, EPOCHS, STEPS_PER_EPOCH, EVAL_EVERY = 2, 6, 3, 5  # 200 samples, 8 per batch, 4 micro-batches a step
STEPS = EPOCHS * STEPS_PER_EPOCH
_seed = int(os.environ.get("THIRDPARTY_DDP_SEED") or random.randrange(1 << 32))
_rng = random.Random(_seed)  # the test's own randomness; the seed is printed with every stop


@pytest.fixture(scope="module", autouse=True)
def ranks():
    """torchrun's ranks forked from one server that imported the script (tests/forked.py ``behind``)."""
    with behind(SCRIPT):
        yield


def job(storage: Path, out: Path, destroy: str) -> list[str]:
    """The user's command line: the same for the first run and for the resume."""
    args = ("--storage", str(storage), "--out", str(out), "--destroy", destroy)
    return torchrun(RANKS, SCRIPT, *args, "--step-sleep", "0.05")


def results(out: Path) -> dict[str, Any]:
    return {
        "losses": [read_losses(out / f"losses-{r}.jsonl") for r in range(RANKS)],
        "evals": read_losses(out / "evals.jsonl"),
        "final": [torch.load(out / f"final-{r}.pt", weights_only=True) for r in range(RANKS)],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("thirdparty-ddp-reference")
    done = run(job(d / "ckpt", d / "out", "after"))
    assert done.returncode == 0, done.stderr[-3000:]
    ref = results(d / "out")
    assert [s for s, _ in ref["losses"][0]] == list(range(1, STEPS + 1))
    assert [s for s, _ in ref["evals"]] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert ref["losses"][0] != ref["losses"][1]  # each rank logs its own shard's loss
    return ref


@pytest.mark.parametrize("destroy", ["after", "inside"])
def test_a_third_party_ddp_script_stopped_by_sigterm_to_torchrun_resumes_exactly(tmp_path, reference, destroy):
    storage, out = tmp_path / "ckpt", tmp_path / "out"
    # An odd step: the periodic save of the step before (every 2 steps) is then sometimes still being
    # written when the stop comes (most often on a loaded machine), and the emergency save settles it first.
    at = 2 * _rng.randint(1, (STEPS - 5) // 2) + 1
    where = f"SIGTERM to torchrun after step {at} (test seed {_seed}, --destroy {destroy})"
    print(where)
    first = stop_when(job(storage, out, destroy), after_step(out / "losses-0.jsonl", at), signal_to(signal.SIGTERM))
    assert first.returncode == 1, (where, first.returncode, first.stderr[-3000:])  # torchrun SIGTERMed: its own exit
    stops = [read_losses(out / f"losses-{r}.jsonl")[-1][0] for r in range(RANKS)]
    stop = stops[0]
    assert stops == [stop] * RANKS and at <= stop < STEPS, (where, stops)
    for r in range(RANKS):
        assert f"[rank {r}] stopped at step {stop}" in first.stdout, (where, first.stdout)
    inflight = re.findall(rf"\[rank 0\] spotguard\.guard\.stop: (stop at step {stop}: [^\n]*)", first.stderr)
    print(f"stopped at step {stop}; a save in flight: {inflight or 'none'}")

    assert "no final checkpoint" not in first.stderr, where  # none is wanted after a stop: nothing was lost

    # What `spotguard ls` shows: the newest complete checkpoint is the emergency one of the stop step.
    complete = [i for i in scan(open_storage(str(storage))) if i.complete]
    newest = complete[-1]
    assert newest.manifest is not None and (newest.step, newest.manifest.reason) == (stop, "emergency"), where
    assert newest.manifest.world_size == RANKS
    epoch = (stop - 1) // STEPS_PER_EPOCH  # epochs finished: the script sets guard.extra at the end of each
    assert newest.manifest.extra == ({"epoch": epoch} if epoch else {}), where

    second = run(job(storage, out, destroy))  # the same command again
    assert second.returncode == 0, (where, second.stderr[-3000:])
    assert f"resumed from step {stop} (emergency, " in second.stderr, (where, second.stderr[-3000:])
    got = results(out)
    for r in range(RANKS):
        assert got["losses"][r] == reference["losses"][r], (where, r)  # every step once, each bit the same
        assert_same(got["final"][r], reference["final"][r], f"{where}: rank {r}")
    assert got["evals"] == reference["evals"], where

    complete = [i for i in scan(open_storage(str(storage))) if i.complete]
    if destroy == "after":  # the final checkpoint, or the last step's periodic one (sharded ones are never replaced)
        assert complete[-1].step == STEPS, where
    else:  # the group destroyed inside the block: no final checkpoint, and a warning says why
        assert all(i.manifest and i.manifest.reason != "final" for i in complete), where
        assert f"no final checkpoint of step {STEPS}: the process group was destroyed" in second.stderr, where
