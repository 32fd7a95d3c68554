"""ranks.rank(): a process's global rank before any process group, under each launcher's variables."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spotguard.coordination import ranks
from tests.helpers import subprocess_env

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


@pytest.fixture
def launched(monkeypatch):
    """Set a launcher's variables (the others unset) for this test."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)

    def setenv(**values: int) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return setenv


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, 0),  # one process
        ({"RANK": 3, "LOCAL_RANK": 1, "WORLD_SIZE": 4}, 3),  # torchrun, DeepSpeed, Accelerate: RANK rules
        ({"LOCAL_RANK": 0, "NODE_RANK": 0, "WORLD_SIZE": 2}, 0),  # Lightning's launcher, its first process
        ({"LOCAL_RANK": 1, "NODE_RANK": 0, "WORLD_SIZE": 2}, 1),  # Lightning's child: was 0
        ({"LOCAL_RANK": 0, "NODE_RANK": 1, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 2}, 2),
        ({"LOCAL_RANK": 0, "NODE_RANK": 1, "WORLD_SIZE": 4}, 1),  # devices per node unknown: never rank 0
        ({"LOCAL_RANK": 1}, 0),  # one process a wrapper pinned to a GPU: rank 0 as before
        ({"LOCAL_RANK": 1, "WORLD_SIZE": 1}, 0),
    ],
)
def test_rank_before_a_process_group(launched, env, rank):
    launched(**env)
    assert ranks.rank() == rank


def test_lightnings_child_does_not_take_the_writer_lease_its_rank_0_holds(launched, tmp_path):
    """``Trainer(devices=2)`` run as a script: its child process resumes before the process group exists.
    Taking itself for rank 0, it made a lease holder of its own and met rank 0's live lease: ``LeaseHeldError``."""
    from spotguard.integrations._folders import FolderCheckpoints

    launched(LOCAL_RANK=0, NODE_RANK=0, WORLD_SIZE=2)
    first = FolderCheckpoints(str(tmp_path))
    try:
        assert first.newest_verified() is None  # rank 0 holds the lease
        child = (
            "from spotguard.integrations._folders import FolderCheckpoints; "
            f"print(FolderCheckpoints({str(tmp_path)!r}).newest_verified())"
        )
        env = subprocess_env(LOCAL_RANK="1", NODE_RANK="0", WORLD_SIZE="2")
        env.pop("RANK", None)
        done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-3000:]
    finally:
        first.release()
