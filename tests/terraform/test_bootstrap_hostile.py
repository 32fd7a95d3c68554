"""Hostile values never run at boot: the bootstrap template rendered by Terraform with values that
would execute a command or add a unit line if any reached the shell or the unit unquoted, run in a
scratch root; and the modules' validation blocks, evaluated by Terraform, refusing them up front.

Each hostile value touches a marker file of its own if it ever runs. Before the fix,
``run_as = "root$(touch /x)"`` ran at boot (an unquoted heredoc) and a newline in it added a line to
the unit."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .hcl import TERRAFORM, load_module, variables
from .test_bootstrap import fake_system_tools, render_many, terraform_apply

pytestmark = pytest.mark.slow

BASE: dict[str, object] = dict(
    python="python3",
    pip_install="spotguard[aws]==0.1.0",
    code_repo="",
    code_ref="main",
    command="python job.py",
    storage_url="s3://bucket/run-1",
    max_restarts=3,
    hang_timeout=0,
    grace=30,
    run_as="trainer",
    environment={"SPOTGUARD_STOP_ON_ADVISORY": "1"},
)


def hostile(mark: str) -> dict[str, dict[str, object]]:
    """One refused value per case, each touching ``mark``-CASE if it is ever executed."""

    def touch(case: str) -> str:
        return f"$(touch {mark}-{case})"

    line = "\nExecStartPre=/bin/touch " + mark + "-{}"
    return {
        "run_as-subst": {"run_as": "root" + touch("run_as-subst")},
        "run_as-line": {"run_as": "root" + line.format("run_as-line")},
        "python-quote": {"python": f"python3'; touch {mark}-python-quote; '"},
        "pip-quote": {"pip_install": f"x'{touch('pip-quote')}'"},
        "code_repo-quote": {"code_repo": f"https://example.invalid/'{touch('code_repo-quote')}'"},
        "code_repo-option": {"code_repo": f"--upload-pack={mark}-code_repo-option"},
        "code_ref-subst": {"code_ref": "v1" + touch("code_ref-subst")},
        "code_ref-option": {"code_ref": "--upload-pack=x"},
        "command-backslash": {"command": "python job.py \\"},
        "command-line": {"command": "python job.py" + line.format("command-line")},
        "storage-subst": {"storage_url": "s3://bucket/run " + touch("storage-subst")},
        "env-value-line": {"environment": {"A": "1" + line.format("env-value-line")}},
        "env-name-subst": {"environment": {"B" + touch("env-name-subst"): "1"}},
        "grace-subst": {"grace": "30" + touch("grace-subst")},
    }


LABELS = {"pip": "spotguard_package", "storage": "storage URL", "env": "environment", "grace": "max_restarts"}


def _run(script: Path, root: Path, fakebin: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPOTGUARD_BOOTSTRAP_ROOT": str(root), "PATH": f"{fakebin}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)


def _scratch_root(root: Path) -> None:
    """A root where spotguard's venv is already there (a python that accepts any pip call)."""
    python = root / "opt/spotguard/venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)


@pytest.mark.timeout(240)
def test_hostile_values_are_refused_or_inert_and_never_run(tmp_path):
    mark = str(tmp_path / "ran")
    cases = hostile(mark)
    # Shell syntax that passes the checks: it must reach the unit verbatim and run nowhere.
    inert = dict(
        BASE,
        command=f"python job.py $(touch {mark}-inert) `touch {mark}-inert` ; touch {mark}-inert && echo '$HOME' \"x\"",
        pip_install="spotguard[aws]>=0.1,!=0.2 ~x <y",
    )
    scripts = render_many(tmp_path / "render", [inert] + [dict(BASE, **values) for values in cases.values()])
    fakebin, calls = tmp_path / "fakebin", tmp_path / "calls.log"
    fake_system_tools(fakebin, calls, missing_user="trainer")

    for case, text in zip(cases, scripts[1:], strict=True):
        root = tmp_path / f"root-{case}"
        _scratch_root(root)
        script = tmp_path / f"{case}.sh"
        script.write_text(text)
        ran = _run(script, root, fakebin)
        out = ran.stdout + ran.stderr  # the script logs through tee to stdout
        assert not [p.name for p in tmp_path.glob("ran-*")], f"{case}: a hostile value ran\n{out}"
        unit = root / "etc/systemd/system/spotguard-job.service"
        assert not (unit.exists() and "ExecStartPre" in unit.read_text()), f"{case}: a unit line was added"
        label = LABELS.get(case.split("-")[0], case.split("-")[0])
        assert ran.returncode != 0 and f"spotguard bootstrap: {label}" in out, (case, out)
        assert not unit.exists(), case  # stopped before writing the unit

    root = tmp_path / "root-inert"
    _scratch_root(root)
    (tmp_path / "inert.sh").write_text(scripts[0])
    ran = _run(tmp_path / "inert.sh", root, fakebin)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    unit = (root / "etc/systemd/system/spotguard-job.service").read_text().splitlines()
    assert (
        f"ExecStart=/opt/spotguard/venv/bin/spotguard run -v --storage s3://bucket/run-1 --max-restarts 3 --grace 30 -- {inert['command']}"
        in unit
    )
    assert [ln.split("=", 1)[0] for ln in unit if "=" in ln] == [
        "Description",
        "After",
        "Wants",
        "Type",
        "User",
        "WorkingDirectory",
        "Environment",
        "Environment",
        "Environment",
        "ExecStart",
        "KillMode",
        "KillSignal",
        "TimeoutStopSec",
        "Restart",
        "RestartSec",
        "RestartPreventExitStatus",
        "SuccessExitStatus",
        "WantedBy",
    ]

    made = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ran-"))
    assert made == [], f"hostile values ran: {made}"
    assert not (calls.exists() and "ExecStartPre" in calls.read_text())


# Valid values for each module's variables without a default (hostile ones then replace some).
REQUIRED = {
    "aws": {
        "region": "us-east-1",
        "image_id": "ami-0123456789abcdef0",
        "subnet_ids": ["subnet-1"],
        "security_group_ids": ["sg-1"],
        "bucket_name": "my-checkpoints",
        "command": "python train.py --name 'a b' --pct 50% --cost $$5",
        "code_repo": "https://github.com/example/train.git",
        "code_ref": "release/v1.0",
    },
    "gcp": {
        "project": "my-project",
        "region": "us-central1",
        "zones": ["us-central1-a"],
        "image": "projects/deeplearning-platform-release/global/images/family/pytorch",
        "network": "default",
        "subnetwork": "default",
        "bucket_name": "my-checkpoints",
        "command": "python train.py",
        "code_repo": "git@github.com:example/train.git",
    },
    "azure": {
        "resource_group_name": "rg",
        "location": "westeurope",
        "image": {"publisher": "p", "offer": "o", "sku": "s", "version": "latest"},
        "subnet_id": "/subscriptions/x/subnet",
        "admin_ssh_public_key": "ssh-ed25519 AAAA",
        "storage_account_name": "mycheckpoints",
        "command": "python train.py",
        "code_repo": "ssh://git@example.com/team/train.git",
    },
}
HOSTILE_VARS = {
    "run_as": "root$(touch /x)",
    "command": "python train.py \\",
    "code_repo": "--upload-pack=/tmp/evil",
    "code_ref": "-v1",
    "python": "-cimport os",
    "max_restarts": 1.5,
    "hang_timeout": -1,
    "grace": 100000,
    "spotguard_package": "spotguard'$(id)'",
    "checkpoint_prefix": "run$(id)",
}


def _variables_only(module: str, dest: Path) -> str:
    """The module's variables.tf alone: Terraform evaluates its validation blocks with no provider."""
    dest.mkdir(parents=True)
    return (TERRAFORM / module / "variables.tf").read_text() + 'output "ok" {\n  value = true\n}\n'


@pytest.mark.timeout(240)
@pytest.mark.parametrize("module", ["aws", "gcp", "azure"])
def test_module_validation_refuses_each_hostile_value(module, tmp_path):
    declared = variables(load_module(TERRAFORM / module))
    missing = [name for name, body in declared.items() if "default" not in body and name not in REQUIRED[module]]
    assert set(REQUIRED[module]) <= set(declared)
    assert not missing, f"add valid values for {missing}"
    config = _variables_only(module, tmp_path / "ok")
    rc, out = terraform_apply(tmp_path / "ok", config, REQUIRED[module])
    assert rc == 0, out  # the defaults (run_as = "spotguard" included) and valid values pass
    assert declared["run_as"]["default"] != "root"

    shutil.rmtree(tmp_path / "ok")
    config = _variables_only(module, tmp_path / "bad")
    rc, out = terraform_apply(tmp_path / "bad", config, {**REQUIRED[module], **HOSTILE_VARS})
    assert rc != 0
    refused = {name for name in HOSTILE_VARS if f"var.{name} " in out or f"var.{name}\n" in out}
    assert refused == set(HOSTILE_VARS), f"not refused: {sorted(set(HOSTILE_VARS) - refused)}\n{out[-3000:]}"
