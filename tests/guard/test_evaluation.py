"""A notice during an evaluation (``guard.evaluation()``): the resumed run evaluates again from the
start with the same random draws, then trains on exactly as an uninterrupted run does.

The evaluation comes after the loader's last batch of an epoch, where a stop used to resume into one
extra epoch (the loader's state said "epoch ended") with the RNG streams as the evaluation left them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.checkpoint.engine import Cut, Tracked
from spotguard.storage import open_storage

from ..forked import installed
from ..helpers import WORKERS, run

pytestmark = pytest.mark.slow
WORKER = WORKERS / "eval_cut.py"


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with installed(WORKER):  # every run of the file forks from one server: one Python start, one import torch
        yield


def job(storage: Path, log: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), "--storage", str(storage), "--log", str(log), *args]


def rows(log: Path) -> list[list]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def stop_in_an_evaluation_and_resume(tmp_path: Path, *common: str, epoch: int = 1) -> None:
    """A reference run; a run stopped at the second batch of ``epoch``'s evaluation, then resumed: the
    resumed run starts with the cut evaluation, from its start, with the same draws; then the rest."""
    ref_log, cut_log, resumed_log = tmp_path / "ref.jsonl", tmp_path / "cut.jsonl", tmp_path / "resumed.jsonl"
    storage = tmp_path / "run"
    # Three runs of the worker, one after another, each a process forked from the module's server.
    done = [
        run(cmd)
        for cmd in (
            job(tmp_path / "ref", ref_log, "--final", str(tmp_path / "ref.pt"), *common),
            job(storage, cut_log, "--notice-epoch", str(epoch), *common),
            job(storage, resumed_log, "--final", str(tmp_path / "resumed.pt"), *common),
        )
    ]
    codes = [d.returncode for d in done]
    assert codes == [0, EXIT_PREEMPTED, 0], [(d.returncode, d.stderr[-3000:]) for d in done]

    ref, cut, resumed = rows(ref_log), rows(cut_log), rows(resumed_log)
    assert cut == ref[: len(cut)]  # the same run up to the notice
    assert cut[-1][0] == "eval" and cut[-1][1] == epoch, "the notice fell inside the epoch's evaluation"
    begun = next(i for i, r in enumerate(ref) if r[:2] == ["eval", epoch])
    assert len(cut) - begun == 1, "the evaluation was left at its second batch"
    assert resumed == ref[begun:]
    got, want = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_notice_during_an_evaluation_resumes_it_from_its_start_exactly(tmp_path: Path, workers: str) -> None:
    stop_in_an_evaluation_and_resume(tmp_path, "--num-workers", workers)


@pytest.mark.timeout(300)
def test_a_periodic_checkpoint_written_before_the_evaluation_is_its_resume_point(tmp_path: Path) -> None:
    """Epochs of 6 steps, ``every_steps=6``: the periodic checkpoint of step 12 is committed at ``guard.step(12)``,
    before epoch 1's evaluation, with the loader at its last batch (not yet ended) and the streams the
    evaluation then finds: the state a cut would save. The stop inside the evaluation keeps it (nothing is
    written twice), and the resume from it is exact as well."""
    stop_in_an_evaluation_and_resume(tmp_path, "--every-steps", "6")
    (info,) = [i for i in scan(open_storage(str(tmp_path / "run"))) if i.step == 12]
    assert info.complete and info.manifest is not None and info.manifest.reason == "periodic", info


@pytest.mark.timeout(300)
def test_a_notice_during_an_evaluation_before_the_first_step_resumes_it_exactly(tmp_path: Path) -> None:
    """nanoGPT evaluates at iteration 0, before any training step. No step was known yet, so the cut did
    not apply to the stop's checkpoint of step 0: it held the streams as the evaluation left them, and
    every value of the resumed run differed from the uninterrupted run's."""
    stop_in_an_evaluation_and_resume(tmp_path, "--eval-first", epoch=-1)


def test_a_cut_applies_only_to_its_own_step_and_never_to_the_final_checkpoint() -> None:
    tracked = Tracked({}, {"epoch": 1})
    tracked.cut = Cut(12, {"torch": torch.get_rng_state()}, {"epoch": 1})
    assert tracked.cut_at(12) is tracked.cut
    assert tracked.cut_at(13) is None  # a later step: the state is that step's
    assert tracked.cut_at(12, final=True) is None  # the end of the run: as it is


def test_a_cut_does_not_apply_once_the_loop_went_past_the_evaluation(caplog: pytest.LogCaptureFixture) -> None:
    tracked = Tracked({}, {"epoch": 1})
    tracked.cut = Cut(12, {"torch": torch.get_rng_state()}, {"epoch": 1})
    tracked.extra["epoch"] = 2  # the end-of-epoch code ran before the stop
    assert tracked.cut_at(12) is None
    assert "guard.extra changed after the evaluation began" in caplog.text
