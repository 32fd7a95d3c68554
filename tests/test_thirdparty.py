"""A script we did not write (tests/workers/thirdparty_charlstm.py: an LSTM language model with a carried hidden
state, EMA weights in a dict, an epoch loop and a per-epoch LR step) stopped and resumed for real.

SIGINT reaches it through `spotguard run` (a terminal's Ctrl-C), SIGTERM directly (a shutdown); either
way it stops with an emergency checkpoint and resumes to the same per-step losses and the same
final weights, EMA and token count as an uninterrupted run.
"""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path

import pytest
import torch

from spotguard import EXIT_PREEMPTED, checkpoint
from spotguard.storage import open_storage

from .helpers import WORKERS, after_step, read_losses, run, signal_to, stop_when

pytestmark = pytest.mark.slow

SCRIPT = WORKERS / "thirdparty_charlstm.py"
EPOCHS, STEPS_PER_EPOCH = 3, 8  # every_steps=4: the last step of every epoch is also a periodic one
_rng = random.Random()


def script(*args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--epochs", str(EPOCHS), *args]


def outputs(d: Path) -> tuple[Path, Path, Path]:
    d.mkdir(parents=True, exist_ok=True)
    return d / "ckpt", d / "losses.jsonl", d / "final.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[int, float]], Path, Path]:
    storage, losses, final = outputs(tmp_path_factory.mktemp("charlstm-reference"))
    proc = run(script("--storage", str(storage), "--losses", str(losses), "--final", str(final)))
    assert proc.returncode == 0, proc.stderr
    return read_losses(losses), final, storage


def stop_at(cmd: list[str], losses: Path, at: int, sig: int, storage: Path, resumed: int | None = None) -> int:
    """Run until step ``at``, send ``sig``: exit 75 with an emergency checkpoint of the last step; returns that step."""
    first = stop_when([*cmd, "--step-sleep", "0.05"], after_step(losses, at), signal_to(sig))
    assert first.returncode == EXIT_PREEMPTED, (at, first.stderr)
    if resumed is not None:
        assert f"resumed from step {resumed} (emergency, " in first.stderr, (at, first.stderr)
    assert "KeyboardInterrupt" not in first.stderr, at
    stopped = read_losses(losses)[-1][0]
    assert f"[charlstm] stopped at step {stopped}" in first.stdout, (at, first.stdout)
    newest = checkpoint.latest(open_storage(str(storage)))
    assert newest is not None and newest.manifest is not None
    assert (newest.step, newest.manifest.reason) == (stopped, "emergency"), (at, first.stderr)
    if cmd[1:4] == ["-m", "spotguard", "run"]:
        assert "SIGINT received: forwarding it to the job" in first.stderr, (at, first.stderr)
    return stopped


def test_a_third_party_rnn_script_stopped_by_sigint_and_sigterm_resumes_exactly(tmp_path, reference):
    """SIGINT through `spotguard run` (a terminal's Ctrl-C), then, resumed directly, SIGTERM (a shutdown),
    then resumed through `spotguard run` to the end: one chain of runs, as a user's job lives."""
    ref_losses, ref_final, _ = reference
    storage, losses, final = outputs(tmp_path)
    job = script("--losses", str(losses), "--final", str(final))
    supervised = [sys.executable, "-m", "spotguard", "run", "--storage", str(storage), "--", *job]
    direct = [*job, "--storage", str(storage)]
    last = EPOCHS * STEPS_PER_EPOCH - 4  # each stop lands inside the loop, not in its exit
    first = stop_at(supervised, losses, _rng.randint(2, last - 8), signal.SIGINT, storage)
    second = stop_at(direct, losses, _rng.randint(first + 2, last), signal.SIGTERM, storage, resumed=first)

    done = run(supervised)
    assert done.returncode == 0, (first, second, done.stderr)
    assert f"resumed from step {second} (emergency, " in done.stderr, (first, second, done.stderr)
    by_step: dict[int, float] = {}
    for step, loss in read_losses(losses):  # a replayed step, if any, must match too
        assert loss == dict(ref_losses)[step], (first, second, step)
        by_step[step] = loss
    assert sorted(by_step.items()) == ref_losses
    got, want = torch.load(final, weights_only=True), torch.load(ref_final, weights_only=True)
    assert got["tokens"] == want["tokens"] == EPOCHS * STEPS_PER_EPOCH * 64
    for part in ("model", "ema"):
        assert got[part].keys() == want[part].keys()
        for k in want[part]:
            assert torch.equal(got[part][k], want[part][k]), (first, second, part, k)


def test_the_final_checkpoint_holds_the_state_after_the_loop(reference):
    """The last step of the last epoch was also a periodic checkpoint; the LR step and the epoch
    counter that follow it are in the final checkpoint of that step, the only one of its step."""
    _, _, storage = reference
    infos = [i for i in checkpoint.scan(open_storage(str(storage))) if i.complete]
    last = infos[-1]
    assert last.manifest is not None and (last.step, last.manifest.reason) == (EPOCHS * STEPS_PER_EPOCH, "final")
    assert [i.step for i in infos].count(last.step) == 1
    assert last.manifest.extra == {"epoch": EPOCHS}
    state = torch.load(storage / last.name / "state.pt", weights_only=True)
    assert state["objects"]["scheduler"]["last_epoch"] == EPOCHS
    assert state["objects"]["hidden"] == {"value": None}  # reset after the epoch, as the script does
