"""Accelerate + AcceleratorGuard: stopped by SIGTERM, a cloud notice, during an evaluation and during
warm-up, resumed each time with load_state, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import random
import re

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.ops.rehearsal.compare import compare

from ..helpers import after_step, read_losses, subprocess_env
from . import runs

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

SCRIPT = "accelerate_train.py"
STEPS = 70
# 32 batches per epoch: the run crosses two epoch ends; saves every 15 steps, evaluations (4 batches,
# dropout on and noisy inputs: random draws) every 16, at each epoch's end too.
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "16", "--eval-augment", "--interval", "0.2")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with runs.forked(SCRIPT):  # the example's runs fork from one server: one start, one import of each library
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("accelerate-reference"), *ARGS)


def test_accelerate_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    runs.stop_by_signal_then_cloud_notice(SCRIPT, tmp_path, ARGS, STEPS, mock_metadata, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
    assert_same_final_checkpoint(tmp_path, reference)


def test_accelerate_notice_during_evaluation_and_warmup_still_checkpoints(tmp_path, reference):
    # At an epoch's last step: the resumed run evaluates again with the same draws, then begins the next epoch.
    runs.stop_during_evaluation_then_warmup(SCRIPT, tmp_path, ARGS, [32], 4, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
    assert_same_final_checkpoint(tmp_path, reference)


def assert_same_final_checkpoint(run_dir, reference) -> None:
    """The stored final checkpoints are equal as `spotguard rehearse --reference` compares them: the weights,
    the optimizer, the loaders' positions and Accelerate's ``random_states_0.pkl`` (every stream seeded)."""
    same = compare(str(run_dir / "ckpt"), str(reference[1].parent / "ckpt"))
    assert same.exact and same.step == STEPS and not same.skipped, same.line()
    assert same.compared > 600, same.line()  # Python's Mersenne Twister state alone is 625 values


def test_accelerate_trains_through_the_notice_window_and_resumes_from_its_second_checkpoint(
    tmp_path, reference, mock_metadata
):
    """``$SPOTGUARD_DEADLINE_POLICY=use-window`` and an AWS spot notice 8 s ahead: the emergency checkpoint
    at once, training on, a second one before the deadline; the resume replays nothing and is exact."""
    from spotguard.ops.mockmeta import endpoint_env

    server = mock_metadata("aws")
    env = subprocess_env(SPOTGUARD_DEADLINE_POLICY="use-window", **endpoint_env("aws", server.url))
    losses = tmp_path / "losses.jsonl"
    first = runs.stop_when(
        SCRIPT,
        tmp_path,
        (*ARGS, "--step-sleep", "0.15", "--providers", "aws", "--window-margin", "1"),
        after_step(losses, 4),
        lambda proc: server.mock.trigger("spot", warning=8),
        env=env,
    )
    assert first.returncode == EXIT_PREEMPTED, first.stderr[-4000:]
    done = [i for i in runs.checkpoints(tmp_path) if i.complete]
    opened, stopped = (i.step for i in done if i.manifest.reason == "emergency")
    assert 4 <= opened and stopped - opened >= 3, (opened, stopped, first.stderr[-4000:])
    assert read_losses(losses)[-1][0] == stopped  # trained on after the first checkpoint, up to the second
    assert not any(opened < i.step < stopped for i in done)  # no periodic save inside the window
    assert re.search(
        rf"emergency checkpoint of step {stopped} committed .*T-[0-9.]+s before the deadline", first.stderr
    )
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
    assert [s for s, _ in read_losses(losses)] == list(range(1, STEPS + 1))  # resumed at the second: no replay


def test_accelerate_notice_in_an_evaluation_after_its_steps_periodic_checkpoint_runs_it_again(tmp_path, reference):
    """``--save-before-eval``: the periodic checkpoint of step 16 is committed before its evaluation (mid-epoch),
    which a SIGTERM then cuts short. That checkpoint holds no cut: resumed from it, the run would skip the
    evaluation and its draws. The stop commits the cut state of step 16 in its place, and the resume runs
    the evaluation again and goes on as the reference (the losses after it depend on its draws)."""
    args = (*ARGS[:2], "--every-steps", "16", *ARGS[4:], "--save-before-eval")

    def in_eval() -> bool:
        return any(e["event"] == "eval_batch" and e["step"] == 16 for e in runs.events(tmp_path))

    slow = ("--eval-sleep", "2", "--eval-sleep-step", "16")
    first = runs.stop_when(SCRIPT, tmp_path, (*args, *runs.SLOW, *slow), in_eval, runs.sigterm)
    assert first.returncode == EXIT_PREEMPTED, first.stderr[-4000:]
    assert read_losses(tmp_path / "losses.jsonl")[-1][0] == 16
    assert "committing the evaluation's state in its place" in first.stderr, first.stderr[-4000:]
    # The periodic one is superseded, and pruned by the next save (never on the deadline's clock).
    *superseded, info = [i for i in runs.checkpoints(tmp_path) if i.step == 16]  # scan: the highest revision last
    assert [i.name for i in superseded] == ["step-00000016"]
    assert info.name == "step-00000016.r1" and info.complete and info.manifest.reason == "emergency", info
    last = runs.finish_identically(SCRIPT, tmp_path, args, reference)
    assert "resumed inside the evaluation after step 16" in last.stderr
    assert sum(e["event"] == "eval_batch" and e["step"] == 16 for e in runs.events(tmp_path)) > 4  # run again
