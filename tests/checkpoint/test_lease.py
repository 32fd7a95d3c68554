"""The writer lease in one process: another writer's record is written straight into the storage, as a
job on another machine would (the two-process tests are in tests/guard/test_lease.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from spotguard import checkpoint
from spotguard.checkpoint import lease as record_mod
from spotguard.checkpoint import leaseholder
from spotguard.checkpoint.folders import layout
from spotguard.checkpoint.lease import LEASE, LeaseRecord
from spotguard.checkpoint.leaseholder import Lease
from spotguard.errors import LeaseHeldError, LeaseLostError, PreconditionFailedError, StorageError
from spotguard.storage import Storage, open_storage


@pytest.fixture
def storage(tmp_path) -> Storage:
    return open_storage(str(tmp_path / "run"))


def other_writer(storage: Storage, *, age: float = 0.0, ttl: float = 60.0, released: bool = False) -> LeaseRecord:
    """Another machine's record, renewed ``age`` seconds ago: created, or put over the current one."""
    now = time.time() - age
    other = LeaseRecord("run-b", "other-host", 4242, now, now, ttl, released=released, owner="b" * 16)
    for _ in range(20):  # a heartbeat may renew between our read and our write: read again
        try:
            _, token = storage.get_versioned(LEASE)
        except FileNotFoundError:
            token = None
        try:
            storage.put_conditional(LEASE, other.to_bytes(), token=token)
            return other
        except PreconditionFailedError:
            continue
    raise AssertionError("could not put the other writer's record")


def test_acquire_creates_the_record_and_release_marks_it(storage):
    lease = Lease(storage, ttl_s=30)
    mine = lease.acquire()
    on_disk = record_mod.read(storage)
    assert on_disk == mine and on_disk.live() and on_disk.owner == lease.owner
    lease.release()
    on_disk = record_mod.read(storage)
    assert on_disk.released and not on_disk.live()
    with pytest.raises(LeaseLostError, match="released"):
        lease.fence()


def test_a_live_lease_of_another_job_is_refused_with_its_holder_named(storage):
    other_writer(storage, age=5)
    with pytest.raises(LeaseHeldError, match=r"host other-host pid 4242, holding for 5 s") as e:
        Lease(storage).acquire()
    assert e.value.holder.run_id == "run-b"
    assert "takeover" in str(e.value)
    assert record_mod.read(storage).host == "other-host"  # untouched


@pytest.mark.parametrize("state", ["expired", "released", "takeover"])
def test_an_expired_released_or_deliberately_taken_lease_is_taken_over(storage, state):
    # An expired one only once this process saw it unchanged for its TTL: a short one here.
    other_writer(storage, age=100 if state == "expired" else 1, ttl=0.5 if state == "expired" else 30)
    if state == "released":
        other_writer(storage, age=1, ttl=30, released=True)
    lease = Lease(storage, takeover=state == "takeover", takeover_grace_s=0)
    t0 = time.monotonic()
    lease.acquire()
    assert (time.monotonic() - t0 >= 0.5) == (state == "expired")
    assert record_mod.read(storage).owner == lease.owner
    lease.release()


@pytest.mark.parametrize("ttl", [0.5, 60.0, 3600.0])
def test_a_takeover_on_purpose_waits_until_the_holder_s_fenced_manifest_has_landed(tmp_path, monkeypatch, ttl):
    # The holder (on another machine) fenced its manifest just before the takeover: the manifest may land
    # up to the fence's deadline (a request in flight then a little later). The taker's resume must come
    # after it, without waiting half of a long lease.
    storage = open_storage(str(tmp_path / f"run-{ttl}"))
    holder = Lease(storage, ttl_s=ttl)
    with monkeypatch.context() as m:
        m.setattr(leaseholder.socket, "gethostname", lambda: "other-host")
        holder.acquire()
    deadline = holder.fence()
    slept: list[float] = []
    taker = Lease(storage, takeover=True, sleep=slept.append)
    taker.acquire()
    assert time.monotonic() + sum(slept) >= deadline + 5.0, (slept, deadline - time.monotonic())
    assert deadline - time.monotonic() <= 20.0 and sum(slept) <= 25.0, slept
    with pytest.raises(LeaseLostError):
        holder.fence()
    taker.release()


def test_a_writer_whose_lease_was_taken_over_is_fenced_and_told_by_whom(storage):
    lost: list[str] = []
    lease = Lease(storage, ttl_s=30, on_lost=lost.append)
    lease.acquire()
    lease.fence()  # still ours
    other_writer(storage)  # taken over (expired on its side, or on purpose)
    with pytest.raises(LeaseLostError, match="now held by run run-b on host other-host pid 4242"):
        lease.fence()
    assert lost and "other-host" in lost[0]
    with pytest.raises(LeaseLostError):
        lease.fence()  # and for good
    lease.release()  # no effect on the other's record
    assert record_mod.read(storage).owner == "b" * 16


def test_the_heartbeat_renews_and_notices_a_takeover(storage):
    lost = threading.Event()
    lease = Lease(storage, ttl_s=0.6, on_lost=lambda why: lost.set())
    first = lease.acquire()
    deadline = time.monotonic() + 10  # a loaded machine may starve the thread for a while
    while record_mod.read(storage).renewed_at == first.renewed_at:
        assert time.monotonic() < deadline, "the heartbeat never renewed the lease"
        time.sleep(0.05)
    assert record_mod.read(storage).owner == lease.owner
    other_writer(storage)
    assert lost.wait(5), "the heartbeat did not notice the takeover"
    assert not lease.held


def test_commits_are_fenced_by_the_lease_their_writer_was_given(storage):
    def save(step: int, lease: Lease | None) -> None:
        fence = lease.fence if lease is not None else None
        checkpoint.write(storage, step, {"x.bin": lambda f: f.write(b"x")}, reason="periodic", fence=fence)

    save(1, None)  # no lease: unfenced, as before
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    save(2, lease)
    other_writer(storage)
    with pytest.raises(LeaseLostError):
        save(3, lease)
    assert [i.step for i in checkpoint.scan(storage) if i.complete] == [1, 2]  # step 3 has no manifest


@pytest.mark.parametrize("how", ["write", "write_dir", "copy", "prepare"])
def test_a_writer_that_lost_the_run_deletes_and_writes_nothing_of_the_new_holder_s_save(storage, tmp_path, how):
    # The new holder is saving step 3 (its files are there, its manifest not yet): the old writer's save
    # of the same step used to clear them as leftovers and store its own before its commit was refused.
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    other_writer(storage)
    storage.put_bytes("step-00000003/x.bin", b"the new holder's")
    folder = tmp_path / "trainer"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"old")
    source = open_storage(str(tmp_path / "tier"))
    checkpoint.write(source, 3, {"x.bin": lambda f: f.write(b"old")}, reason="periodic")
    if how == "prepare":  # rank 0 of a collective save (sharded, trainer folders in a group): a status all agree on
        status = layout.prepare(storage, "step-00000003", lease.fence)
        assert status.startswith("rank 0 cannot prepare") and "LeaseLostError" in status, status
    else:
        with pytest.raises(LeaseLostError):
            if how == "write":
                checkpoint.write(storage, 3, {"x.bin": lambda f: f.write(b"o")}, reason="periodic", fence=lease.fence)
            elif how == "write_dir":
                checkpoint.write_dir(storage, 3, folder, reason="periodic", fence=lease.fence)
            else:
                checkpoint.copy(source, storage, checkpoint.scan(source)[0], fence=lease.fence)
    assert storage.get_bytes("step-00000003/x.bin") == b"the new holder's"


def test_a_storage_fault_at_the_save_s_first_fence_costs_it_nothing(storage, monkeypatch, caplog):
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    put, faults = storage.put_conditional, [StorageError("503 Slow Down")]

    def flaky(*args, **kwargs):
        if faults:
            raise faults.pop()
        return put(*args, **kwargs)

    storage.put_bytes("step-00000004/x.bin", b"a save killed before its manifest")  # fenced before it goes
    monkeypatch.setattr(storage, "put_conditional", flaky)
    checkpoint.write(storage, 4, {"x.bin": lambda f: f.write(b"x")}, reason="emergency", fence=lease.fence)
    assert [i.step for i in checkpoint.scan(storage) if i.complete] == [4] and not faults
    assert "cannot renew the writer lease before a save (503 Slow Down)" in caplog.text
    lease.release()


def test_a_renewal_refused_twice_before_a_save_deletes_nothing(storage, monkeypatch):
    # Refused, read back as ours, refused again: a takeover landed in between, as likely as not.
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    storage.put_bytes("step-00000004/x.bin", b"maybe the new holder's")

    def refused(*args, **kwargs):
        raise PreconditionFailedError("the record changed")

    monkeypatch.setattr(storage, "put_conditional", refused)
    with pytest.raises(PreconditionFailedError):
        checkpoint.write(storage, 4, {"x.bin": lambda f: f.write(b"x")}, reason="periodic", fence=lease.fence)
    assert storage.get_bytes("step-00000004/x.bin") == b"maybe the new holder's"


def test_a_record_of_this_process_left_unreleased_is_taken_over(storage):
    """An earlier Guard of this program that was never closed: same host and pid, another owner."""
    first = Lease(storage, ttl_s=30)
    first.acquire()
    second = Lease(storage, ttl_s=30)
    second.acquire()
    with pytest.raises(LeaseLostError):
        first.fence()
    second.release()


def test_a_dead_process_of_this_host_does_not_hold_the_lease(storage, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    now = time.time()
    dead = LeaseRecord(
        "run-x", socket.gethostname(), pid, now, now, 60.0, owner="x" * 16, pidns=record_mod.pid_namespace()
    )
    storage.put_conditional(LEASE, dead.to_bytes(), token=None)
    assert pid != os.getpid()
    lease = Lease(storage)
    lease.acquire()
    lease.release()


def test_the_fence_goes_with_the_writer_not_with_the_storage(storage, tmp_path):
    """Only the writers the holder handed its fence to are fenced: no table of leased storages decides
    it behind their backs (a second storage object for the same URL, or this one written without the
    fence, as a test or an offline tool does, commits as before)."""
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    other_writer(storage)  # taken over: this lease is lost
    with pytest.raises(LeaseLostError):
        checkpoint.write_dir(storage, 1, folder(tmp_path / "a"), reason="periodic", fence=lease.fence)
    checkpoint.write(storage, 2, {"x.bin": lambda f: f.write(b"x")}, reason="periodic")  # the same object, unfenced
    checkpoint.write_dir(open_storage(str(tmp_path / "run")), 3, folder(tmp_path / "b"), reason="periodic")
    assert [i.step for i in checkpoint.scan(storage) if i.complete] == [2, 3]  # step 1 has no manifest


def folder(path):
    path.mkdir()
    (path / "model.bin").write_bytes(b"weights")
    return path


def test_the_record_keeps_its_format_for_readers(storage):
    lease = Lease(storage, ttl_s=12)
    mine = lease.acquire()
    assert LeaseRecord.from_bytes(mine.to_bytes()) == mine
    older = json.loads(mine.to_bytes())
    del older["owner"]  # a record written before the owner field: still readable
    assert LeaseRecord.from_bytes(json.dumps(older).encode()).owner == ""
    lease.release()


def test_a_two_tier_writer_fences_the_upload_not_the_local_tier(storage, tmp_path):
    """The fence guards the run's storage: the local tier (nobody else's) still commits, the upload of a
    writer that lost its lease to the durable storage does not."""
    import torch

    from spotguard.checkpoint.engine import Tracked
    from spotguard.checkpoint.single import SingleEngine

    local = open_storage(str(tmp_path / "local"))
    lease = Lease(storage, ttl_s=30)
    lease.acquire()
    engine = SingleEngine(storage, local, keep=3, on_commit=lambda c: None, fence=lease.fence)
    tracked = Tracked({"model": torch.nn.Linear(2, 2)}, {})
    engine.stage(tracked, 1, "periodic")(threading.Event())
    other_writer(storage)
    with pytest.raises(LeaseLostError):
        engine.stage(tracked, 2, "periodic")(threading.Event())
    assert [i.step for i in checkpoint.scan(local) if i.complete] == [1, 2]
    assert [i.step for i in checkpoint.scan(storage) if i.complete] == [1]


def test_a_fenced_manifest_must_land_within_half_the_lease_whatever_the_callers_deadline(tmp_path):
    """A manifest retried past the lease (up to 300 s of retries against a 60 s lease) could land after
    another job, seeing no renewal, took the run over and resumed from an older step. The fence bounds it."""
    from spotguard.storage.local import LocalStorage

    deadlines: list[tuple[float | None, float]] = []

    class Recording(LocalStorage):
        def put_bytes(self, key, data, *, exclusive=False, deadline=None):
            if key.endswith("/manifest.json"):
                deadlines.append((deadline, time.monotonic()))
            return super().put_bytes(key, data, exclusive=exclusive, deadline=deadline)

    storage = Recording(str(tmp_path / "run"))
    lease = Lease(storage, ttl_s=10)
    lease.acquire()
    write = lambda step, **kw: checkpoint.write(  # noqa: E731
        storage, step, {"x.bin": lambda f: f.write(b"x")}, reason="periodic", **kw
    )
    write(1, fence=lease.fence)  # a periodic save: no deadline of its own
    write(2, fence=lease.fence, deadline=time.monotonic() + 3)  # an emergency one: the sooner wins
    write(3)  # unfenced: unbounded, as before
    (d1, t1), (d2, t2), (d3, _) = deadlines
    assert d1 is not None and t1 < d1 <= t1 + 5.0
    assert d2 is not None and d2 <= t2 + 3.0
    assert d3 is None
    lease.release()
