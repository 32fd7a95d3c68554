"""``spotguard rehearse``: real jobs through real preemptions (the mock IMDS over HTTP), measured.

Each test runs ``python -m spotguard rehearse`` for real: it starts the mock metadata server, runs
the job on one "machine" after another, sends the notices and kills a job still running at its
deadline. The report is read from its ``--json`` document.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.forked import behind, via
from tests.helpers import REPO, WORKERS, run, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# The notice's lead costs nothing while jobs stop at once (the next machine starts when the job is
# gone); a long one keeps a notice sent while a job still imports on a loaded machine from killing it.
LEAD = ("--lead", "60")
TRAIN = ("examples/train.py", "--quiet", "--steps", "120", "--every-steps", "20", "--interval", "0.2")
EVAL = ("--eval-every", "15")  # evaluations inside guard.evaluation(), 4 batches each


@pytest.fixture(scope="module")
def jobs():
    """The jobs' server: where a test's command is ``via(..., server=jobs)``, each machine's job (and the
    reference run) forks from it, not a Python start and ``import torch`` of its own; rehearse itself
    runs as is. The five-preemption tests keep real starts: their notices land during the imports."""
    scripts = ("examples/train.py", *(WORKERS / f"rehearse_{w}.py" for w in ("forgets_data", "ignores_notices")))
    with behind(*scripts) as server:
        yield server


def rehearse(tmp_path: Path, *args: str, command: list[str]) -> tuple[int, dict, str]:
    """Run a rehearsal from the checkout's root; its return code, JSON report and stderr."""
    proc = run(
        [sys.executable, "-m", "spotguard", "rehearse", "--json", "--replacement-delay", "0.1", *args, "--", *command],
        cwd=REPO,
        timeout=360,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def report(doc: dict, err: str) -> str:
    """A failed rehearsal, shown whole (a string: pytest cuts the middle of a long tuple's repr)."""
    ref = doc.get("reference") or {}
    keep = ("index", "stop_step", "landed", "resumes_at", "committed", "steps_lost", "steps_replayed", "killed")
    pre = [{k: p.get(k) for k in keep} for p in doc.get("preemptions", [])]
    lines = [f"reference: {ref.get('line')}", *ref.get("differences", []), f"preemptions: {pre}"]
    return "\n".join([*lines, f"machines: {doc.get('machines')}, steps: {doc.get('steps')}", err[-3000:]])


def test_train_through_five_preemptions_loses_nothing_and_is_exact(tmp_path):
    # Seed 0 draws 0.9, 0.7, 0.3 and 0.4 s of training, and puts the 4th notice 2.8 s after its
    # machine's start, while the job is still starting; the 2nd waits for the next evaluation and the
    # 3rd for the next save in flight. 120 steps leave the 5th room: with 90, an idle machine (quick
    # restarts, so the 4th lands late) finished before it, and a loaded one stopped at the last step.
    code, doc, err = rehearse(
        tmp_path,
        *("-n", "5", "--mtbf", "0.5", "--seed", "0", *LEAD, "--fresh-local", "--after-restart", "1"),
        *("--during-save", "1", "--during-eval", "1", "--storage", str(tmp_path / "ckpt"), "--reference"),
        command=[sys.executable, *TRAIN, *EVAL, "--step-sleep", "0.03"],
    )
    assert code == 0, report(doc, err)
    pre = doc["preemptions"]
    assert len(pre) == 5 and doc["machines"] == 6 and doc["steps"] == 120
    assert [p["committed"] for p in pre] == [True] * 5
    assert [p["steps_lost"] for p in pre] == [0] * 5
    assert [p["steps_replayed"] for p in pre] == [0] * 5
    assert [p["after_restart"] for p in pre] == [False, False, False, True, False]
    landed = [p["landed"].split("+") for p in pre]  # what the heartbeat said the job was doing then
    assert "evaluation" in landed[1] and "save" in landed[2], landed
    stops = [p["stop_step"] for p in pre]
    print(json.dumps({"preemptions": pre, "machines": doc["machines_detail"]}))  # shown in full on a failure
    assert stops == sorted(stops) and stops[-1] < 120, stops
    for before, p in zip([None, *stops[:-1]], pre, strict=True):  # every figure measured
        limit = 60 if p["after_restart"] else 5  # one sent while the job starts is seen once it trains
        assert 0 < p["detection_s"] < limit, p
        if before is None or p["stop_step"] > before:  # a checkpoint written on this machine, and the time after
            assert 0 < p["save_s"] < 10 and p["teardown_s"] > 0 and 0 < p["idle_s"] <= 60, p
        else:  # the notice sent while it started stopped it at its resume point: nothing new to write
            assert p["after_restart"] and 0 <= p["save_s"] < 10, p
        assert p["restart_s"] > 0 and p["resume_s"] > 0 and p["restore_s"] is not None and not p["killed"], p
    # The planner, given the costs measured here, predicts the goodput measured here.
    assert abs(doc["goodput"] - doc["planner_goodput"]) <= 0.02, (doc["goodput"], doc["planner_goodput"], doc["costs"])
    assert doc["costs"]["interval_s"] > 0 and doc["costs"]["mtbf_s"] > 0
    ref = doc["reference"]
    assert ref["exact"] is True and ref["step"] == ref["reference_step"] == 120 and ref["compared"] > 100, ref
    assert ref["line"].startswith("exact: yes")


def test_train_through_two_azure_evictions_approves_each_once_committed_and_is_exact(tmp_path, jobs):
    # Azure's notice is a Preempt scheduled event on the mock IMDS (30 s ahead); the job's Guard
    # approves it (StartRequests) once its emergency checkpoint is committed, and the machine counts as
    # gone from then. Seed 0 at a mean of 0.5 s draws 0.9 and 0.7 s of training: both within the job.
    code, doc, err = rehearse(
        tmp_path,
        *("-n", "2", "--mtbf", "0.5", "--seed", "0", "--notices", "azure", "--fresh-local"),
        *("--storage", str(tmp_path / "ckpt"), "--reference"),
        command=via(
            *("examples/train.py", "--quiet", "--steps", "60", "--every-steps", "20", "--interval", "0.2"),
            *("--step-sleep", "0.03"),
            server=jobs,
        ),
    )
    assert code == 0, report(doc, err)
    pre = doc["preemptions"]
    assert [(p["committed"], p["steps_lost"], p["steps_replayed"]) for p in pre] == [(True, 0, 0)] * 2, pre
    assert doc["machines"] == 3 and doc["steps"] == 60
    for m in doc["machines_detail"][:2]:  # approved after the commit, long before the event's NotBefore
        assert m["latest_time"] <= m["approved"] < m["deadline"] - 20, m
    assert all(p["idle_s"] < 10 for p in pre), pre  # the idle window ends at the approval, not at NotBefore
    ref = doc["reference"]
    assert ref["exact"] is True and ref["step"] == ref["reference_step"] == 60, ref


def test_a_job_that_does_not_resume_its_data_is_not_exact(tmp_path, jobs):
    # The worker tracks everything but its data generator; each step's loss is in guard.extra.
    code, doc, _ = rehearse(
        tmp_path,
        *("-n", "1", "--mtbf", "0.5", "--seed", "0", "--lead", "20"),
        *("--storage", str(tmp_path / "ckpt"), "--reference"),
        command=via(WORKERS / "rehearse_forgets_data.py", server=jobs),
    )
    assert code == 1
    (p,) = doc["preemptions"]
    assert p["committed"] and p["steps_lost"] == 0  # the rehearsal itself went well
    ref = doc["reference"]
    assert ref["exact"] is False
    assert ref["first_difference_step"] == p["stop_step"] + 1, ref  # the first batch after the resume
    assert ref["line"].startswith(f"exact: no, first difference at step {p['stop_step'] + 1}")


def test_a_job_that_ignores_notices_fails_the_rehearsal(tmp_path, jobs):
    # It makes steps but watches nothing and saves nothing: killed at the deadline, its steps lost.
    code, doc, err = rehearse(
        tmp_path,
        *("-n", "1", "--mtbf", "0.5", "--seed", "0", "--lead", "1", "--plot", str(tmp_path / "r.png")),
        *("--storage", str(tmp_path / "ckpt")),
        command=via(WORKERS / "rehearse_ignores_notices.py", server=jobs),
    )
    assert code == 1, err[-3000:]
    (p,) = doc["preemptions"]
    assert p["killed"] and p["committed"] is False and p["steps_lost"] == p["stop_step"] > 0
    assert p["steps_replayed"] == p["stop_step"] and p["detection_s"] is None
    assert doc["all_committed"] is False and doc["steps"] == 60  # the replacement redid it all
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"]


def test_a_sigterm_to_rehearse_ends_the_job_it_runs(tmp_path):
    # A CI job's timeout or a `kill`: the job on the current "machine" must not be left running.
    pid_file = tmp_path / "job.pid"
    job = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotguard", "rehearse", "-n", "1", "--mtbf", "100", "--", sys.executable, "-c", job],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the job outlived the rehearsal"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("held", ["ckpt", "ckpt.reference"])
def test_a_storage_that_holds_checkpoints_is_refused_untouched(tmp_path, held):
    """``ckpt.reference``: the reference run's storage, kept from an earlier ``--reference`` rehearsal; the
    message named --storage, which was empty."""
    storage = tmp_path / "ckpt"
    (tmp_path / held / "step-5").mkdir(parents=True)
    (tmp_path / held / "step-5" / "state.pt").write_bytes(b"x")
    cmd = [sys.executable, "-m", "spotguard", "rehearse", "--storage", str(storage), "--reference"]
    proc = run([*cmd, "--", sys.executable, "-c", "0"], cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "starts from scratch" in proc.stderr, proc.stderr
    option = "--reference-storage" if held.endswith("reference") else "--storage (nothing"
    assert f"give an empty {option}" in proc.stderr, proc.stderr
    assert (tmp_path / held / "step-5" / "state.pt").read_bytes() == b"x"


def test_hf_trainer_through_five_preemptions_loses_nothing_and_is_exact(tmp_path):
    # The Trainer's own folder is on each machine's fresh local disk: only the storage survives.
    # Seed 4 at a mean of 1 s draws 0.27, 0.10, 0.50 and 0.08 s of training, and puts the 4th notice
    # 1.65 s after its machine's start, while the Trainer is still importing. The 1st then waits for the
    # evaluation of step 10 (slowed, so the notice cuts it short and the resume runs it again) and the
    # 3rd for the next save (of step 20, or 30 should a busy machine hide that one from rehearse's
    # 5 ms looks): the callback's heartbeat marks. Seven starts in all (six machines and
    # the reference) are most of the time: a start is ~3 s of imports (torch, transformers' lazy module
    # index); the 40 steps of 0.05 s leave the notices room on an idle machine.
    code, doc, err = rehearse(
        tmp_path,
        *("-n", "5", "--mtbf", "1", "--seed", "4", *LEAD, "--fresh-local", "--after-restart", "1"),
        *("--during-eval", "1", "--during-save", "1", "--storage", str(tmp_path / "ckpt"), "--reference"),
        command=[
            sys.executable,
            *("examples/hf_trainer.py", "--quiet", "--steps", "40", "--every-steps", "10", "--interval", "0.2"),
            *("--eval-steps", "10", "--eval-sleep", "0.1", "--eval-sleep-step", "10"),
            *("--step-sleep", "0.05", "--output-dir", "{local}/hf-output"),
        ],
    )
    assert code == 0, report(doc, err)
    pre = doc["preemptions"]
    assert len(pre) == 5 and doc["machines"] == 6 and doc["steps"] == 40
    assert [(p["committed"], p["steps_lost"], p["steps_replayed"]) for p in pre] == [(True, 0, 0)] * 5
    assert [p["after_restart"] for p in pre] == [False, False, False, True, False]
    landed = [p["landed"].split("+") for p in pre]
    assert "evaluation" in landed[0] and "save" in landed[2], landed
    stops = [p["stop_step"] for p in pre]
    for before, p in zip([0, *stops[:-1]], pre, strict=True):
        # no Guard events in a Trainer: the heartbeat's stop flag and the manifests say it
        limit = 60 if p["after_restart"] else 5  # one sent while the job imports is seen once it trains
        assert 0 < p["detection_s"] < limit and p["restart_s"] > 0, p
        # A Trainer that sees the notice before its first step (while it imports, or during the cut
        # evaluation it runs again first) stops at the resumed checkpoint: nothing new is committed on
        # that machine, so there is no commit to count its teardown from.
        assert (p["teardown_s"] or 0) > 0 if p["stop_step"] > before else p["teardown_s"] is None, (before, p)
    ref = doc["reference"]
    assert ref["exact"] is True and ref["step"] == ref["reference_step"] == 40, ref


def test_a_deepspeed_job_is_preempted_during_its_save(tmp_path):
    # Seed 4 at a mean of 1 s draws 0.27 s of training; the notice then waits for the next save (every
    # 10 steps) in flight: DeepSpeedGuard's heartbeat mark. Without it the notice never comes and the
    # job finishes first. (The other integrations' marks: tests/integrations/test_marks.py.)
    pytest.importorskip("deepspeed")
    code, doc, err = rehearse(
        tmp_path,
        *("-n", "1", "--mtbf", "1", "--seed", "4", *LEAD, "--during-save", "1", "--storage", str(tmp_path / "ckpt")),
        command=[
            sys.executable,
            *("examples/deepspeed_train.py", "--quiet", "--steps", "40", "--every-steps", "10", "--interval", "0.2"),
            *("--step-sleep", "0.05"),
        ],
    )
    assert code == 0, report(doc, err)
    (p,) = doc["preemptions"]
    assert doc["steps"] == 40 and p["committed"] and p["steps_lost"] == 0 and "save" in p["landed"].split("+"), p
