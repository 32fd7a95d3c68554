"""`spotguard run` does not restart a job into an error a restart would meet again: it exits 78 once."""

from __future__ import annotations

import sys
import textwrap

import pytest

from spotguard.checkpoint.lease import LEASE
from spotguard.heartbeat import EXIT_CONFIG
from tests.helpers import run, subprocess_env

pytestmark = pytest.mark.slow

JOB = """
import sys
import torch
import spotguard

class LossScaler:
    pass

class Engine:
    def state_dict(self):
        return {"loss_scaler": LossScaler()}
    def load_state_dict(self, sd):
        pass

guard = spotguard.Guard(every_steps=3, providers=[], async_save={async_save})
guard.track(model=torch.nn.Linear(2, 2), engine=Engine())
guard.resume()
with guard:
    for step in range(1, 10):
        guard.step(step)
sys.exit(0)
"""


def supervise(tmp_path, child: list[str]):
    cmd = [
        sys.executable,
        "-m",
        "spotguard",
        "run",
        "-v",  # the run's INFO lines (each start) the tests read
        "--storage",
        str(tmp_path / "ckpt"),
        "--backoff",
        "0.05",
        "--max-restarts",
        "2",
    ]
    return run([*cmd, "--", *child], env=subprocess_env(), timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_job_whose_state_no_resume_could_load_is_not_restarted(tmp_path, async_save):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB.replace("{async_save}", str(async_save))))
    proc = supervise(tmp_path, [sys.executable, str(script)])
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert proc.stderr.count("starting: ") == 1  # not restarted into the same error
    assert "UnloadableStateError: cannot checkpoint tracked object 'engine'" in proc.stderr
    assert "a restart would meet again (exit code 1" in proc.stderr
    written = [p.name for p in (tmp_path / "ckpt").iterdir()] if (tmp_path / "ckpt").exists() else []
    assert not [n for n in written if not n.startswith(LEASE)], written  # the writer lease only


@pytest.mark.timeout(60)
def test_a_job_that_exits_78_itself_is_not_restarted(tmp_path):
    proc = supervise(tmp_path, [sys.executable, "-c", "import sys; sys.exit(78)"])
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert proc.stderr.count("starting: ") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("below", ["ckpt", ""])
def test_a_job_whose_storage_is_no_folder_is_not_restarted(tmp_path, below):
    """A storage path that is a file, or below one (a typo, a volume not mounted): the lease write (or the
    listing) is refused, a StorageAccessError that names the file; restarting would meet it again."""
    (tmp_path / "file").write_text("not a folder")
    job = "import spotguard, torch; spotguard.Guard(providers=[]).track(x=torch.zeros(2)).resume()"
    storage = tmp_path / "file" / below if below else tmp_path / "file"
    cmd = [sys.executable, "-m", "spotguard", "run", "-v", "--storage", str(storage)]
    proc = run(
        [*cmd, "--backoff", "0.05", "--max-restarts", "2", "--", sys.executable, "-c", job], env=subprocess_env()
    )
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert proc.stderr.count("starting: ") == 1, proc.stderr
    assert "StorageAccessError" in proc.stderr, proc.stderr
    assert f"below {tmp_path / 'file'}: it is a file, not a folder" in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "job, error",
    [
        ("spotguard.Guard('s3:/bucket/run', providers=[])", "did you mean s3://bucket/run?"),
        (
            "from spotguard.integrations.accelerate import AcceleratorGuard; AcceleratorGuard(object(), every_steps=-1)",
            "every_steps",
        ),
    ],
    ids=["guard-url", "integration-option"],
)
def test_a_job_whose_guard_cannot_be_built_is_not_restarted(tmp_path, job, error):
    """A malformed storage URL or a bad option, raised by the constructor itself (before it had a heartbeat):
    `spotguard run` restarted the job into the same ConfigError until its budget was spent, then exited 2."""
    proc = supervise(tmp_path, [sys.executable, "-c", f"import spotguard; {job}"])
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    assert proc.stderr.count("starting: ") == 1, proc.stderr
    assert "ConfigError" in proc.stderr and error in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_a_job_that_caught_the_error_and_finished_is_finished(tmp_path):
    """The heartbeat is marked where the error is raised: a job that caught it and went on to exit 0 finished."""
    job = "import spotguard\ntry:\n    spotguard.Guard('s3:/bucket/run', providers=[])\nexcept spotguard.errors.ConfigError:\n    pass"
    proc = supervise(tmp_path, [sys.executable, "-c", job])
    assert proc.returncode == 0 and "the job finished" in proc.stderr, proc.stderr
