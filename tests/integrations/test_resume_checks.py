"""Every trainer integration checks a resumed data loader as the Guard does (``data.check_loaders``).

As a new user would: the example is stopped by a real SIGTERM, then started again with another
``--num-workers`` or ``--batch-size`` than the checkpoint's (the HF Trainer keeps no loader state:
its batch size alone). Another worker count is moved to the new
count (the dataset is map-style: the position is the sampler's), with a warning naming both, and the
run continues at the very sample it stopped at; torchdata alone fails with a bare ``AssertionError``
at every restart. Another batch size is refused with both sizes, exit 78 under ``spotguard run`` with
no restart, unless ``rebatch="accept"``; Lightning alone trains on without a word.
"""

from __future__ import annotations

import contextlib
import random
import sys

import pytest

from spotguard import EXIT_CONFIG

from ..forked import behind, launched
from ..helpers import REPO, after_step, read_losses, run, subprocess_env
from . import runs

pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

STEPS = 40
EPOCH = 32  # 256 samples in batches of 8
ARGS = ("--steps", str(STEPS), "--every-steps", "0", "--interval", "0.2")
SCRIPTS = {"accelerate_train.py": "accelerate", "lightning_train.py": "lightning"}
_rng = random.Random()


@pytest.fixture(scope="module")
def servers():
    """``servers(script)``: the server the example's runs, and its jobs under ``spotguard run``, fork
    from (tests/forked.py ``behind``), one per example, started at its first run."""
    with contextlib.ExitStack() as stack:
        started = {}

        def server(script: str):
            if script not in started:
                started[script] = stack.enter_context(behind(REPO / "examples" / script))
            return started[script]

        yield server


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def example(request, tmp_path_factory, servers):
    """(script, its uninterrupted reference run)."""
    pytest.importorskip(SCRIPTS[request.param])
    servers(request.param)
    return request.param, runs.reference_run(request.param, tmp_path_factory.mktemp("reference"), *ARGS)


def stopped_early(script: str, run_dir) -> int:
    """The example stopped by SIGTERM early in its first epoch; returns the stop step (checkpointed)."""
    at = _rng.randint(3, 12)
    first = runs.stop_when(script, run_dir, (*ARGS, *runs.SLOW), after_step(run_dir / "losses.jsonl", at), runs.sigterm)
    return runs.assert_stopped(first, run_dir)


def test_resumed_with_more_workers_continues_at_the_same_sample(tmp_path, example):
    script, (reference, _) = example
    stopped = stopped_early(script, tmp_path)
    resumed = runs.run(script, tmp_path, *ARGS, "--num-workers", "2")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "AssertionError" not in resumed.stderr
    assert "saved with num_workers=0 and has num_workers=2 now: it continues at the same sample" in resumed.stderr
    want = dict(reference)
    logged = dict(read_losses(tmp_path / "losses.jsonl"))
    assert sorted(logged) == list(range(1, STEPS + 1))
    # The rest of the epoch: the same batches, the same dropout, bit for bit.
    for step in range(stopped + 1, EPOCH + 1):
        assert logged[step] == want[step], (step, stopped)


def supervised(script: str, run_dir, *args: str):
    """The example under ``spotguard run`` (which restarts a crash, never a configuration error); its
    job forked from the example's server."""
    cmd = [sys.executable, "-m", "spotguard", "run", "-v", "--storage", str(run_dir / "ckpt"), "--backoff", "0.05"]
    python, path, *args = runs.command(script, run_dir, *args)
    return run([*cmd, "--", python, *launched(path), *args], env=subprocess_env(), cwd=run_dir)


@pytest.mark.parametrize("script", ["accelerate_train.py", "hf_trainer.py", "lightning_train.py"])
def test_resumed_with_another_batch_size_is_refused_unless_accepted(tmp_path, script, servers):
    pytest.importorskip({**SCRIPTS, "hf_trainer.py": "transformers"}[script])
    servers(script)
    stopped = stopped_early(script, tmp_path)
    refused = supervised(script, tmp_path, *ARGS, "--batch-size", "16")
    assert refused.returncode == EXIT_CONFIG, refused.stderr[-4000:]
    assert "was saved with batch_size=8 and has batch_size=16 now" in refused.stderr
    assert "rebatch='accept'" in refused.stderr
    assert refused.stderr.count("starting: ") == 1  # not restarted into the same refusal
    assert read_losses(tmp_path / "losses.jsonl")[-1][0] == stopped  # not one step trained

    accepted = runs.run(script, tmp_path, *ARGS, "--batch-size", "16", "--rebatch", "accept")
    assert accepted.returncode == 0, accepted.stderr[-4000:]
    assert "saved with batch_size=8 and has batch_size=16 now (rebatch='accept')" in accepted.stderr
    assert read_losses(tmp_path / "losses.jsonl")[-1][0] == STEPS
