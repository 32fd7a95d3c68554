"""Two real jobs on one storage URL: the writer lease keeps them from mixing one run.

Each job is ``tests/guard/lease_job.py`` (a counter, a checkpoint every 2 steps, its name in every
manifest) in a process of its own (forked from one server that imported torch and spotguard, as a
process of its own behaves; a child of `spotguard run` starts as usual), on local disk here; ``tests/storage/test_cloud_lease.py`` runs the
first scenario on S3, GCS and Azure.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard import Guard, LeaseHeldError, checkpoint, heartbeat
from spotguard.checkpoint import lease as lease_record
from spotguard.heartbeat import EXIT_LEASE_HELD, EXIT_PREEMPTED
from spotguard.storage import Storage, open_storage
from tests.forked import Served
from tests.helpers import (
    WORKERS,
    _finish,
    _start,
    azure_approvals_read_the_lease,
    run,
    run_ranks,
    subprocess_env,
    wait_until,
)

JOB = Path(__file__).with_name("lease_job.py")


@pytest.fixture(scope="module", autouse=True)
def forked_jobs() -> Iterator[None]:
    """The module's lease_job.py runs fork from one server: a Python start and ``import torch`` saved a
    job. Its top level is the whole job, so nothing of it runs in the server (``Served``), which imports
    what a job imports (no optimizer, no data loader: not torch._dynamo or torchdata)."""
    served = Served(("torch", "torch.distributed", "spotguard", "spotguard.guard"))
    try:
        with served.scripts(JOB):
            yield
    finally:
        served.close()


def job(url: str, name: str, *args: str) -> list[str]:
    return [sys.executable, str(JOB), url, "--name", name, *args]


def start_and_wait_ready(cmd: list[str], ready: Path, env: dict[str, str] | None = None):
    started = _start([*cmd, "--ready", str(ready)], env, None)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if started[0].poll() is not None or time.monotonic() > deadline:
            done = _finish(*started, 1)
            raise AssertionError(f"{cmd} ended (exit {done.returncode}) before it was ready:\n{done.stderr[-3000:]}")
        time.sleep(0.02)
    return started


def writers(storage: Storage) -> list[tuple[int, str, float]]:
    """(step, writer, commit time) of every complete checkpoint, oldest first."""
    out = []
    for info in checkpoint.scan(storage):
        assert info.complete, f"{info.name}: {info.status} ({info.problem})"
        written = dt.datetime.fromisoformat(info.manifest.time).timestamp()
        out.append((info.step, info.manifest.extra["writer"], written))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_job_is_refused_and_a_takeover_stops_the_first(tmp_path: Path):
    refused_then_taken_over(str(tmp_path / "run"), tmp_path)


def refused_then_taken_over(url: str, tmp_path: Path) -> None:
    """Job A runs; B (through `spotguard run`) exits 73 at once naming A and is not restarted; C takes
    over on purpose and commits; A commits nothing more and stops with ``LeaseLostError``."""
    # A's lease of 10 s: a takeover on purpose waits for a manifest A fenced just before to land (5 s, and
    # 5 for a request in flight).
    first = start_and_wait_ready(job(url, "A", "--sleep", "0.2", "--ttl", "10"), tmp_path / "a-ready")
    try:
        # Through `spotguard run`: refused at once, named, and not restarted (it would meet A again).
        second = run(
            [sys.executable, "-m", "spotguard", "run", "-v", "--max-restarts", "3", "--storage", url, "--"]
            + [sys.executable, str(JOB), url, "--name", "B", "--steps", "20"],
            env=subprocess_env(),
            timeout=120,
        )
        assert second.returncode == EXIT_LEASE_HELD, second.stderr[-3000:]
        assert f"pid {first[0].pid}" in second.stderr and "another job is writing to" in second.stderr
        assert "not restarting" in second.stderr and second.stderr.count("starting:") == 1
        assert "while this job watched" not in second.stderr  # at once, not after watching A's record
        # A takeover on purpose: C writes, and A commits nothing more and stops with a clear error.
        third = run(job(url, "C", "--steps", "4"), env=subprocess_env(SPOTGUARD_TAKEOVER="1"), timeout=120)
        assert third.returncode == 0, third.stderr[-3000:]
        done = _finish(*first, 60)
    finally:
        if first[0].poll() is None:
            os.killpg(first[0].pid, signal.SIGKILL)
    assert done.returncode not in (0, EXIT_PREEMPTED)
    assert "LeaseLostError" in done.stderr and "now held by run" in done.stderr, done.stderr[-3000:]
    storage = open_storage(url)
    taken = lease_record.read(storage)
    assert taken is not None and taken.released  # C's record, released at its clean exit
    history = writers(storage)
    assert [w for _, w, _ in history if w == "B"] == []
    last_a = max(s for s, w, _ in history if w == "A")
    assert f"C: resumed at step {last_a}" in third.stdout  # A's last commit came before C's resume
    first_c = min(t for _, w, t in history if w == "C")
    assert all(t < first_c for _, w, t in history if w == "A")
    assert [w for s, w, _ in history if s > last_a] == ["C", "C"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_the_lease_expires_the_next_job_proceeds_and_the_old_one_commits_nothing(tmp_path: Path):
    url = str(tmp_path / "run")
    first = start_and_wait_ready(job(url, "A", "--ttl", "2"), tmp_path / "a-ready")
    try:
        first[0].send_signal(signal.SIGSTOP)  # a machine that hangs: no step, no renewal
        storage = open_storage(url)
        deadline = time.monotonic() + 30
        while lease_record.read(storage).live():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second = run(job(url, "B", "--steps", "4"), timeout=120)
        assert second.returncode == 0, second.stderr[-3000:]
        first[0].send_signal(signal.SIGCONT)
        done = _finish(*first, 60)
    finally:
        if first[0].poll() is None:
            os.killpg(first[0].pid, signal.SIGKILL)
    assert done.returncode not in (0, EXIT_PREEMPTED)
    assert "LeaseLostError" in done.stderr, done.stderr[-3000:]
    history = writers(storage)
    last_a = max(s for s, w, _ in history if w == "A")
    assert [w for s, w, _ in history if s > last_a] == ["B", "B"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_a_preemption_the_replacement_starts_without_waiting(tmp_path: Path):
    """The lease is released with the emergency checkpoint, not at the close that a reclaimed machine
    may never reach: the replacement starts while the old job still lingers, well within its TTL."""
    url = str(tmp_path / "run")
    first = start_and_wait_ready(job(url, "A", "--linger", "300"), tmp_path / "a-ready")
    try:
        first[0].send_signal(signal.SIGTERM)
        storage = open_storage(url)
        deadline = time.monotonic() + 60
        while not lease_record.read(storage).released:
            assert first[0].poll() is None and time.monotonic() < deadline, "not released after the stop"
            time.sleep(0.05)
        stopped = writers(storage)[-1]
        assert stopped[1] == "A"
        t0 = time.monotonic()
        second = run(job(url, "B", "--steps", "2"), timeout=120)
        assert first[0].poll() is None  # A still there (lingering), its lease released
    finally:
        os.killpg(first[0].pid, signal.SIGKILL)
        _finish(*first, 10)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"B: resumed at step {stopped[0]}" in second.stdout
    assert time.monotonic() - t0 < 60  # A's lease (60 s) was not waited for


def test_a_guard_dropped_without_a_close_is_not_kept_alive_and_gives_the_lease_back(tmp_path: Path):
    """The heartbeat thread holds the guard weakly: an unclosed guard (its model, its process groups) is
    freed, and its lease released at the next beat instead of being renewed for nobody."""
    storage = open_storage(str(tmp_path / "run"))
    guard = Guard(storage, providers=None, lease_ttl=0.3).track(state={"x": 1})
    guard.save(1)
    assert not lease_record.read(storage).released
    ref = weakref.ref(guard)
    del guard
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 10
    while not lease_record.read(storage).released:
        assert time.monotonic() < deadline, "the lease of a dropped guard was never released"
        time.sleep(0.05)


def test_a_background_save_stops_writing_once_another_job_took_the_lease(tmp_path: Path, monkeypatch):
    """Its commit would be refused anyway; files it went on writing could land over the new holder's. The
    loop, waiting for it (``busy="wait"``), starts no other save, and the cut save is a failure, not a skip."""
    import threading

    import torch

    from spotguard.checkpoint.files import fileio
    from spotguard.errors import LeaseLostError
    from tests.checkpoint.test_lease import other_writer

    write = fileio.DirectFile._write_all

    def slow(self, view, data=0):  # 0.6 s per 16 MB buffer: 160 MB take 6 s
        time.sleep(0.6)
        return write(self, view, data)

    monkeypatch.setattr(fileio.DirectFile, "_write_all", slow)
    storage = open_storage(str(tmp_path / "run"))
    guard = Guard(storage, providers=None, lease_ttl=0.6, every_steps=1, async_save=True, busy="wait")
    guard.track(w=torch.zeros(40 << 20))
    guard.resume()
    guard.step(1)
    pending = guard.saves.in_flight()
    assert pending is not None and pending.step == 1
    threading.Timer(0.5, other_writer, args=(storage,)).start()  # taken over while step 2 waits for step 1
    t0 = time.monotonic()
    with pytest.raises(LeaseLostError, match="now held by run run-b"):
        guard.step(2)
    assert time.monotonic() - t0 < 3.0, "the save went on writing for a lost lease"
    assert pending.done() and pending.cancelled and guard.saves.pending is None  # no save of step 2 started
    assert not (tmp_path / "run" / "step-00000002").exists()
    assert not any(i.complete for i in checkpoint.scan(storage))
    with pytest.raises(LeaseLostError):  # the save cut short failed, as its commit would have
        guard.wait()
    guard.close(save=False)


def test_a_guard_refused_by_a_live_lease_names_it_and_marks_the_heartbeat(tmp_path: Path):
    storage = open_storage(str(tmp_path / "run"))
    now = time.time()
    other = lease_record.LeaseRecord("run-b", "other-host", 4242, now - 30, now, 60.0, owner="b" * 16)
    storage.put_conditional(lease_record.LEASE, other.to_bytes(), token=None)
    guard = Guard(storage, providers=None).track(state={"x": 1})
    with pytest.raises(LeaseHeldError, match="host other-host pid 4242, holding for 30 s"):
        guard.resume()
    assert guard._beat.flags & heartbeat.LEASE_HELD
    assert checkpoint.scan(storage) == []
    assert Guard(storage, providers=None, lease_ttl=None).track(state={"x": 1}).resume() == 0  # opted out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_in_a_process_group_every_rank_is_refused_alike(tmp_path: Path):
    """Rank 0 alone takes the lease; the other ranks hear the refusal instead of waiting for it in a collective."""
    storage = open_storage(str(tmp_path / "run"))
    now = time.time()
    other = lease_record.LeaseRecord("run-b", "other-host", 4242, now, now, 600.0, owner="b" * 16)
    storage.put_conditional(lease_record.LEASE, other.to_bytes(), token=None)
    ranks = run_ranks(
        [sys.executable, str(WORKERS / "dist_teardown.py"), str(tmp_path / "run"), "--steps", "4"], timeout=120
    )
    for rank, done in enumerate(ranks):
        assert done.returncode != 0 and "LeaseHeldError" in done.stderr, (rank, done.stderr[-3000:])
        assert "host other-host pid 4242" in done.stderr, (rank, done.stderr[-3000:])
    assert checkpoint.scan(storage) == [] and lease_record.read(storage) == other


def test_an_azure_eviction_is_approved_only_once_the_lease_is_released(tmp_path: Path, monkeypatch):
    """Azure may evict the machine as soon as its Preempt event is approved: a lease still held then
    would keep the replacement waiting for its TTL. The mock IMDS over real HTTP, the Guard's own
    provider; the lease is read when the approval goes out."""
    import torch

    storage = open_storage(str(tmp_path / "ckpt"))
    with azure_approvals_read_the_lease(storage, tmp_path, monkeypatch) as (provider, sender, released):
        guard = Guard(str(tmp_path / "ckpt"), providers=[provider], interval=0.05)
        guard.track(model=torch.nn.Linear(2, 2))
        with guard:
            assert not guard.step(1)
            sender.send(None)  # type: ignore[arg-type]
            wait_until(lambda: guard.notice is not None, "the Preempt event was never seen")
            assert guard.step(2)  # the emergency checkpoint of step 2, then the approval
        assert released == [True] and sender.approvals() == 1
        assert [i.step for i in checkpoint.scan(storage) if i.complete] == [2]
