"""The Kubernetes and Slurm examples: the manifest's stop path, and the sbatch script run for real."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spotguard import EXIT_PREEMPTED

from .helpers import EXAMPLE, REPO, subprocess_env

K8S = REPO / "examples" / "k8s" / "job.yaml"
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


def test_k8s_job_gives_the_checkpoint_its_grace_and_the_prestop_does_not_kill():
    job = yaml.safe_load(K8S.read_text())
    pod = job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    command = trainer["command"]
    assert command[:2] == ["spotguard", "run"]  # exec form: spotguard run is PID 1 and gets the SIGTERM
    grace = float(next(a.split("=", 1)[1] for a in command if a.startswith("--grace=")))
    assert grace < pod["terminationGracePeriodSeconds"]
    assert any(a.startswith("--storage=gs://") or a.startswith("--storage=s3://") for a in command)
    pre_stop = " ".join(trainer["lifecycle"]["preStop"]["exec"]["command"])
    assert "SPOTGUARD_NOTICE_FILE" in pre_stop
    assert not any(word in pre_stop for word in ("kill", "sleep", "wait", "shutdown"))
    assert {"name": "SPOTGUARD_NOTICE_FILE", "value": "/tmp/spotguard-notice"} in trainer["env"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert any(r["action"] == "Ignore" and r.get("onExitCodes", {}).get("values") == [EXIT_PREEMPTED] for r in rules)
    assert pod["restartPolicy"] == "Never"
    assert "15 s" in K8S.read_text()  # the GKE spot-node note


@pytest.mark.slow
def test_sbatch_script_checkpoints_on_usr1_and_requeues(tmp_path):
    """SIGUSR1 to the batch shell (Slurm's --signal=B:USR1) -> checkpoint, exit 75, scontrol requeue."""
    head = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@90" in head and "#SBATCH --requeue" in head
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck:
        assert subprocess.run([shellcheck, str(SBATCH)]).returncode == 0
    fakebin, calls, storage = tmp_path / "bin", tmp_path / "scontrol.log", tmp_path / "ckpt"
    fakebin.mkdir()
    py = shlex.quote(sys.executable)
    for name, body in {
        "scontrol": f'echo "$*" >> {shlex.quote(str(calls))}',
        "spotguard": f'exec {py} -m spotguard "$@"',
        "python": f'exec {py} "$@"',
    }.items():
        (fakebin / name).write_text(f"#!/bin/sh\n{body}\n")
        (fakebin / name).chmod(0o755)
    shutil.copy(EXAMPLE, tmp_path / "train.py")
    env = subprocess_env(PATH=f"{fakebin}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242", STORAGE=str(storage))
    proc = subprocess.Popen(
        ["bash", str(SBATCH)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while "[train] starting at step 0" not in proc.stdout.readline():
            if proc.poll() is not None:
                pytest.fail(f"sbatch script exited {proc.returncode} before training: {proc.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, out + err
    assert "stopped at step" in out and "requeueing job 4242" in out
    assert calls.read_text().split("\n")[0] == "requeue 4242"
    assert any(storage.glob("step-*/manifest.json"))  # the emergency checkpoint


SKYPILOT = REPO / "examples" / "skypilot" / "hf-trainer.yaml"
RAY = REPO / "examples" / "ray" / "train_ray.py"


def test_skypilot_managed_job_relaunches_on_exit_75_and_runs_the_hf_example():
    task = yaml.safe_load(SKYPILOT.read_text())
    resources = task["resources"]
    assert resources["use_spot"] is True
    recovery = resources["job_recovery"]
    codes = recovery["recover_on_exit_codes"]
    assert EXIT_PREEMPTED in (codes if isinstance(codes, list) else [codes])
    assert recovery["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    assert isinstance(recovery["max_restarts_on_errors"], int) and recovery["max_restarts_on_errors"] >= 0
    assert task["envs"]["SPOTGUARD_STORAGE"].startswith(("s3://", "gs://"))  # a machine's disk goes with it
    # The run's exit status is the script's (set -e), and the script and its flags exist.
    run = task["run"]
    assert run.lstrip().startswith("set -e")
    words = shlex.split(run.split("\n", 1)[1])
    script = REPO / words[words.index("python") + 1]
    assert script == REPO / "examples" / "hf_trainer.py" and script.exists()
    flags = [w for w in words if w.startswith("--")]
    assert "--storage" in flags and all(f'"{flag}"' in script.read_text() for flag in flags)
    extras = re.findall(r"\.\[([a-z,]+)\]", task["setup"])
    pyproject = (REPO / "pyproject.toml").read_text()
    assert extras and all(f"\n{extra} = [" in pyproject for extra in extras[0].split(","))
    assert "torch==2.13.0" in task["setup"]


def test_ray_recipe_imports_without_ray_and_restarts_on_every_failure():
    tree = ast.parse(RAY.read_text())
    top_level = {
        alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    } | {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert "ray" not in top_level  # imported where used: the recipe reads (and loads) without ray
    spec = importlib.util.spec_from_file_location("train_ray", RAY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:  # no bucket: refused before anything starts
        module.main([])
    assert exc.value.code == 2
    loop = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_loop_per_worker")
    calls = {ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)}
    # The attempt ends the way Ray counts a preemption (end_attempt), or as a failure (it raises Preempted).
    assert {"spotguard.Guard", "guard.track", "guard.resume", "guard.step", "end_attempt"} <= calls
    failure = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "FailureConfig")
    assert ast.unparse(failure) == (
        "FailureConfig(max_failures=args.max_failures, max_preemption_failures=args.max_preemptions)"
    )
