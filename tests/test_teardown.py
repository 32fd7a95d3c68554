"""A job that used Guard must exit 0, whatever order the program tears the process group down in.

Each run is a real pair of processes that end by interpreter shutdown, the moment the abort came
("terminate called without an active exception", about 1 run in 4): the Guard's gloo groups, held
past ``dist.destroy_process_group()``, were destroyed only while Python finalized. Most runs start
plain processes with a TCP store on rank 0 (~4x cheaper than torchrun); the first run of each
chain uses torchrun itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import REPO, free_port, subprocess_env

WORKER = REPO / "tests" / "dist_teardown.py"
ORDERS = ("after", "inside", "none", "fsdp2")
RUNS_PER_ORDER = 10  # 40 runs in all


@dataclass
class Run:
    launcher: str
    codes: list[int]
    out: str

    @property
    def clean(self) -> bool:
        return all(code == 0 for code in self.codes) and "terminate called" not in self.out

    def field(self, name: str) -> str:
        found = re.search(rf"\b{name}=(\S+)", self.out)
        assert found, f"no {name}= in the output ({self.launcher}, exit codes {self.codes}):\n{self.out[-3000:]}"
        return found.group(1)


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[int]:
    """Wait for every process; past ``timeout``, kill their sessions (ranks waiting on each other)."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        raise AssertionError(f"still running after {timeout:.0f}s") from None
    return [proc.returncode for proc in procs]


def run_pair(work: Path, args: list[str], *, torchrun: bool, timeout: float = 120) -> Run:
    """One 2-rank job (output in ``work``): torchrun, or two plain processes (rank 0 hosts the TCP store)."""
    port = str(free_port())
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", port, str(WORKER), *args]
        envs = [subprocess_env()]
    else:
        cmd = [sys.executable, str(WORKER), *args]
        envs = [subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=port) for r in range(2)]
    logs = [work / f"out-{i}.log" for i in range(len(envs))]
    procs = []
    for env, log in zip(envs, logs, strict=True):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
    codes = _finish(procs, timeout)
    return Run("torchrun" if torchrun else "processes", codes, "".join(log.read_text() for log in logs))


def chain(tmp: Path, order: str, runs: int) -> list[tuple[str, Run]]:
    """``runs`` jobs on one storage, cycling: uninterrupted, stopped by SIGTERM on rank 1, resumed."""
    storage = tmp / "ckpt"
    done: list[tuple[str, Run]] = []
    last = 0
    for i in range(runs):
        kind = ("uninterrupted", "sigterm", "resumed")[i % 3]
        work = tmp / f"run-{i}"
        work.mkdir()
        args = [str(storage), "--order", order, "--steps", str(last + 6)]
        if kind == "sigterm":
            args += ["--sigterm-at", str(last + 2)]
        run = run_pair(work, args, torchrun=i == 0)
        assert run.clean, f"{order} run {i} ({kind}, {run.launcher}): exit codes {run.codes}\n{run.out[-4000:]}"
        assert int(run.field("resumed")) == last, (order, i, run.out[-2000:])
        stopped, new_last = run.field("stopped"), int(run.field("last"))
        if kind == "sigterm":
            assert stopped != "None" and last + 2 <= new_last < last + 6, (order, i, run.out[-2000:])
        else:
            assert stopped == "None" and new_last == last + 6, (order, i, run.out[-2000:])
        for before, after in re.findall(r"gloo threads before the guard: (\d+), after the block: (\d+)", run.out):
            assert before == after, f"the Guard left gloo threads behind ({order} run {i}):\n{run.out[-2000:]}"
        last = new_last
        done.append((kind, run))
    return done


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_forty_jobs_exit_0_in_every_teardown_order(tmp_path):
    """10 jobs per teardown order (uninterrupted, SIGTERM on one rank, resumed); two chains at a time."""
    with ThreadPoolExecutor(2) as pool:
        futures = {}
        for order in ORDERS:
            (tmp_path / order).mkdir()
            futures[order] = pool.submit(chain, tmp_path / order, order, RUNS_PER_ORDER)
    runs = [run for future in futures.values() for run in future.result()]
    assert len(runs) == 40 and sum(run.launcher == "torchrun" for _, run in runs) == len(ORDERS)
