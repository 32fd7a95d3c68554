"""A job that used Guard must exit 0, whatever order the program tears the process group down in.

Each run is a real pair of processes that end by interpreter shutdown, the moment the abort came
("terminate called without an active exception", about 1 run in 4): the Guard's gloo groups, held
past ``dist.destroy_process_group()``, were destroyed only while Python finalized. The first run of
each chain uses torchrun itself; the others are pairs of processes with a TCP store on rank 0, each
forked from a launcher that imported torch once (a process of its own would pay a Python start and
``import torch`` per rank), and each exits through interpreter shutdown as a process of its own does.
"""

from __future__ import annotations

import gc
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
import torch
import torch.distributed as dist

from spotguard import EXIT_PREEMPTED, Guard, Notice, SpotguardError
from spotguard.checkpoint import latest
from spotguard.coordination import agreement
from tests.helpers import WORKERS, free_port, subprocess_env
from tests.workers.dist_teardown import KINDS, gloo_tids, job_args, newest_step

WORKER = WORKERS / "dist_teardown.py"
ORDERS = ("after", "inside", "none", "fsdp2")
RUNS_PER_ORDER = 6  # 24 runs in all: with the abort in 1 run of 4, all 24 clean by chance: 0.1%


def ours(existing: set[str]) -> int:
    """gloo threads started since ``existing`` (ids) and alive: groups earlier tests left to the
    garbage collector go first. Told apart by id: a thread names itself once it runs."""
    gc.collect()
    return len(gloo_tids() - existing)


def started(existing: set[str]) -> int:
    """``ours``, once the new threads have had time to name themselves."""
    deadline = time.monotonic() + 5
    while not ours(existing) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ours(existing)


@pytest.fixture
def group():
    """A one-rank gloo group; yields the ids of the threads alive once it exists."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.barrier()
    yield set(os.listdir("/proc/self/task"))
    if dist.is_initialized():
        dist.destroy_process_group()


def guarded(tmp_path, **kw) -> Guard:
    return Guard(str(tmp_path), providers=None, **kw).track(model=torch.nn.Linear(2, 2))


def test_leaving_the_block_destroys_the_guards_groups_and_joins_their_threads(tmp_path, group):
    guard = guarded(tmp_path)
    assert started(group) > 0
    with guard:
        guard.step(1)
    assert ours(group) == 0
    assert latest(guard.storage).step == 1  # the final checkpoint came first
    guard.close()  # again: harmless
    dist.destroy_process_group()  # after the block, as PyTorch recommends
    guard.close()
    with pytest.raises(SpotguardError, match="closed"):
        guard.save(2)


@pytest.mark.parametrize("async_save", [False, True])
def test_process_group_destroyed_inside_the_block_skips_the_final_checkpoint(tmp_path, group, caplog, async_save):
    guard = guarded(tmp_path, every_steps=2, async_save=async_save)
    with guard:
        for step in range(1, 4):
            guard.step(step)
        dist.destroy_process_group()
    assert "no final checkpoint of step 3: the process group was destroyed" in caplog.text
    # Synchronous: step 2 committed before the destroy. Async: maybe in flight, and it commits all the
    # same (the background writer coordinates through the store, not a group).
    assert latest(guard.storage).step == 2
    assert ours(group) == 0  # the Guard's are gone


def test_process_group_destroyed_after_a_stop_inside_the_block_is_no_lost_final_checkpoint(tmp_path, group, caplog):
    """After a stop the emergency checkpoint is the run's last: no final one is wanted, so a group destroyed
    before `sys.exit(75)` in the block (a common habit) loses nothing and must not be warned about."""
    guard = guarded(tmp_path, every_steps=2)
    with pytest.raises(SystemExit), guard:
        for step in range(1, 4):
            if step == 3:
                guard.watcher.report(Notice("test", "terminate"))
            if guard.step(step):
                dist.destroy_process_group()
                sys.exit(EXIT_PREEMPTED)
    assert latest(guard.storage).step == 3
    assert "no final checkpoint" not in caplog.text


def test_a_guard_never_closed_has_its_groups_destroyed_at_exit(tmp_path, group):
    guard = guarded(tmp_path)
    guard.save(1)
    assert started(group) > 0
    agreement._close_at_exit()  # what atexit runs before interpreter shutdown
    assert ours(group) == 0


def test_a_closed_guard_entered_again_agrees_on_new_groups(tmp_path, group):
    guard = guarded(tmp_path)
    with guard:
        guard.step(1)
    with guard:
        guard.step(2)
    assert latest(guard.storage).step == 2 and ours(group) == 0


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


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
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


def run_torchrun(work: Path, args: list[str], timeout: float = 120) -> Run:
    """One 2-rank job under torchrun (its output in ``work``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), str(WORKER), *args]
    log = work / "out-0.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    return Run("torchrun", _finish([proc], timeout), log.read_text())


def forked(root: Path, orders: tuple[str, ...], first: int, last: int, timeout: float = 900) -> dict[str, list[Run]]:
    """Jobs ``first``..``last`` of each order's chain (in ``root/ORDER``), each rank a forked process, every
    chain forked from one launcher that imported torch once (``dist_teardown.py --fork-chains``)."""
    log = root / "launcher.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--fork-chains", str(root), str(first), str(last), *orders],
            env=subprocess_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    assert _finish([proc], timeout) == [0], f"the launcher failed: {log.read_text()[-3000:]}"
    runs: dict[str, list[Run]] = {}
    for order in orders:
        for index in range(first, last + 1):
            work = root / order / f"run-{index}"
            codes = [int(c) for c in (work / "codes").read_text().split()] if (work / "codes").exists() else [-1]
            logs = sorted(work.glob("out-*.log"))
            runs.setdefault(order, []).append(Run("forked", codes, "".join(log.read_text() for log in logs)))
    return runs


def launched(tmp: Path, order: str) -> list[tuple[Run, int]]:
    """The first job of a chain, under torchrun, with the newest checkpoint's step after it."""
    storage = tmp / "ckpt"
    (tmp / "run-0").mkdir()
    run = run_torchrun(tmp / "run-0", job_args(storage, order, 0, newest_step(storage)))
    return [(run, newest_step(storage))]


def chain(tmp: Path, order: str, done: list[tuple[Run, int]], rest: list[Run]) -> list[tuple[str, Run]]:
    """The jobs of one storage, cycling: uninterrupted, stopped by SIGTERM on rank 1, resumed.

    Job 0 ran under torchrun (``launched``), the others (``rest``) forked from one launcher that imported
    torch once for every chain (a torchrun start costs ~6 s; most of a plain start is ``import torch``).
    """
    done = list(done)
    for run in rest:
        done.append((run, int((tmp / f"run-{len(done)}" / "newest").read_text())))

    resume_at = 0
    for i, (run, newest) in enumerate(done):
        kind = KINDS[i % 3]
        where = f"{order} run {i} ({kind}, {run.launcher})"
        assert run.clean, f"{where}: exit codes {run.codes}\n{run.out[-4000:]}"
        assert int(run.field("resumed")) == resume_at, (where, run.out[-2000:])
        last, stopped = int(run.field("last")), run.field("stopped")
        if kind == "sigterm":  # every rank stopped at the same step, soon after the signal
            assert stopped == str(last) and resume_at + 2 <= last < resume_at + 5, (where, run.out[-2000:])
        else:
            assert stopped == "None" and last == resume_at + 5, (where, run.out[-2000:])
        left = re.findall(r"gloo threads started by the guard left after the block: (\d+)", run.out)
        assert left == ["0", "0"], f"{where}: the Guard left gloo threads behind\n{run.out[-2000:]}"
        # Destroyed inside the block, the group cannot write the final checkpoint: the last periodic
        # one stays (written in the background, it needs no group, and close() waits for it); periodic
        # checkpoints fall on multiples of every_steps=2, whatever the resume point.
        assert newest == (last - last % 2 if order == "inside" and kind != "sigterm" else last), (where, newest)
        resume_at = newest
    return [(KINDS[i % 3], run) for i, (run, _) in enumerate(done)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_dozen_jobs_exit_0_in_every_teardown_order(tmp_path):
    """6 jobs per teardown order (uninterrupted, SIGTERM on one rank, resumed); two chains at a time."""
    with ThreadPoolExecutor(2) as pool:
        futures = {}
        for order in ORDERS:
            (tmp_path / order).mkdir()
            futures[order] = pool.submit(launched, tmp_path / order, order)
        first = {order: future.result() for order, future in futures.items()}
    rest = forked(tmp_path, ORDERS, 1, RUNS_PER_ORDER - 1)
    runs = [run for order in ORDERS for _, run in chain(tmp_path / order, order, first[order], rest[order])]
    assert len(runs) == len(ORDERS) * RUNS_PER_ORDER and [run.launcher for run in runs].count("torchrun") == len(ORDERS)
