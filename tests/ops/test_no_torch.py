"""``spotguard run``, ``watch``, ``mock-metadata``, ``simulate-preemption`` and ``plan`` start without torch.

Each command runs for real in a fresh interpreter, which reports at exit whether torch was ever
imported: a module on the command's path that imports torch (or an eager ``spotguard/__init__``)
costs every invocation seconds and makes this fail.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

#: Runs ``spotguard ARGS`` as ``python -m spotguard`` does, then prints whether torch was loaded.
WRAPPER = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: print('TORCH-LOADED' if 'torch' in sys.modules else 'NO-TORCH', flush=True))\n"
    "sys.argv = ['spotguard', *sys.argv[1:]]\n"
    "runpy.run_module('spotguard', run_name='__main__')\n"
)


def spotguard(*args: str, code: int = 0, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, *args], env=subprocess_env(**env), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("NO-TORCH"), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_importing_a_notice_provider_does_not_import_torch():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import spotguard.notices.aws, sys; assert 'torch' not in sys.modules, 'torch imported'",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_plan_does_not_import_torch(tmp_path):
    out = spotguard("plan", "--checkpoint-cost", "30", "--restart-cost", "120", "--mtbf", "6", "--json")
    assert json.loads(out.splitlines()[0])["interval_s"] > 0
    stats = tmp_path / "stats.jsonl"
    stats.write_text(json.dumps({"snapshot_s": 1.0, "write_s": 9.0, "restore_s": 5.0}) + "\n")
    spotguard("plan", "--stats", str(stats), "--mtbf", "6")


def test_run_and_its_metrics_do_not_import_torch(tmp_path):
    metrics = tmp_path / "run.jsonl"
    spotguard(
        "run", "--storage", str(tmp_path / "ckpt"), "--metrics-file", str(metrics), "--", sys.executable, "-c", "pass"
    )
    assert [json.loads(line)["event"] for line in metrics.read_text().splitlines()] == ["start", "exit", "end"]


def test_watch_does_not_import_torch(tmp_path):
    notice = tmp_path / "notice.json"
    notice.write_text(json.dumps({"kind": "terminate", "deadline_in": 60}))
    out = spotguard(
        "watch", "--providers", "file", "--interval", "0.05", "--timeout", "30", SPOTGUARD_NOTICE_FILE=str(notice)
    )
    assert "terminate notice" in out


def test_mock_metadata_and_simulate_preemption_do_not_import_torch():
    server = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "mock-metadata", "--cloud", "aws", "--port", "0"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        banner = server.stdout.readline()
        assert "metadata server on http://" in banner, banner + (server.stderr.read() if server.poll() else "")
        url = banner.split(" on ", 1)[1].strip()
        out = spotguard("simulate-preemption", "--cloud", "aws", "--endpoint", url, "--kind", "spot")
        assert "aws spot notice now" in out
    finally:
        server.send_signal(signal.SIGTERM)
        rest, err = server.communicate(timeout=30)
    assert server.returncode == 0, err[-3000:]
    assert rest.rstrip().endswith("NO-TORCH"), rest + err[-2000:]


@pytest.mark.parametrize("args", [["ls"], ["verify"]])
def test_checkpoint_listing_does_not_import_torch(tmp_path, args):
    root: Path = tmp_path / "ckpt"
    root.mkdir()
    spotguard(*args, str(root), code=0 if args == ["ls"] else 1)


def test_the_lazy_package_still_offers_every_public_name_and_subpackage():
    code = (
        "import sys, spotguard\n"
        "assert 'torch' not in sys.modules\n"
        "assert spotguard.checkpoint.scan and spotguard.notices.base.Notice and spotguard.ConfigError\n"
        "assert 'torch' not in sys.modules, 'a light attribute imported torch'\n"
        "missing = [n for n in spotguard.__all__ if getattr(spotguard, n, None) is None]\n"
        "assert not missing, missing\n"
        "from spotguard import EXIT_PREEMPTED, Guard, GuardOptions, Value\n"
        "assert Guard.__module__ == 'spotguard.guard.guard' and EXIT_PREEMPTED == 75\n"
        "assert not hasattr(spotguard, 'nothing_of_that_name')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
