"""The writer lease under clock skew, pid namespaces and hostile records (issue 31): expiry is judged by
watching the record on this process's own monotonic clock, so another machine's clock, ahead or behind,
never lets a live lease be taken over. The other machine's holder is a thread that renews a record
written straight into the storage, its timestamps on its own (skewed) clock."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from spotguard.checkpoint import lease as record_mod
from spotguard.checkpoint.lease import LEASE, LeaseRecord
from spotguard.checkpoint.leaseholder import Lease
from spotguard.errors import CheckpointCorruptError, LeaseHeldError, LeaseLostError, PreconditionFailedError
from spotguard.storage import Storage, open_storage


@pytest.fixture
def storage(tmp_path) -> Storage:
    return open_storage(str(tmp_path / "run"))


def record(skew: float, ttl: float, **fields) -> LeaseRecord:
    """Another machine's record, renewed just now on a clock ``skew`` seconds off ours."""
    now = time.time() + skew
    return dataclasses.replace(LeaseRecord("run-b", "other-host", 4242, now - 300, now, ttl, owner="b" * 16), **fields)


@contextmanager
def renewed(storage: Storage, held: LeaseRecord, every: float = 0.05) -> Iterator[None]:
    """``held`` put into the storage and renewed every ``every`` s until the block ends (or it is taken)."""
    token = storage.put_conditional(LEASE, held.to_bytes(), token=None)
    stop = threading.Event()

    def beat() -> None:
        nonlocal token, held
        while not stop.wait(every):
            held = dataclasses.replace(held, renewed_at=held.renewed_at + every)
            try:
                token = storage.put_conditional(LEASE, held.to_bytes(), token=token)
            except PreconditionFailedError:
                return  # taken over

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def acquire_timed(lease: Lease) -> float:
    t0 = time.monotonic()
    lease.acquire()
    lease.release()
    return time.monotonic() - t0


@pytest.mark.parametrize("skew", [-120.0, -1.5])
def test_a_live_lease_whose_holder_clock_is_behind_is_never_taken_over(storage, skew):
    with renewed(storage, record(skew, ttl=1.0)):
        with pytest.raises(LeaseHeldError, match="renewed its lease while this job watched") as e:
            Lease(storage, ttl_s=1.0).acquire()
        assert "run run-b on host other-host pid 4242" in str(e.value)
        assert record_mod.read(storage).owner == "b" * 16


def test_a_dead_holder_whose_clock_was_behind_is_taken_over_once_watched_for_its_ttl(storage):
    storage.put_conditional(LEASE, record(-120, ttl=0.8).to_bytes(), token=None)
    assert acquire_timed(Lease(storage, ttl_s=30)) >= 0.8


@pytest.mark.parametrize("pidns", ["0123-boot/pid:[4026532999]", ""])
def test_a_pid_this_process_cannot_see_is_never_taken_for_a_dead_process(storage, pidns):
    """Same hostname, another pid namespace (a container with host networking), or a record that does
    not say which: the pid is not judged. A live record is refused, an expired one watched first."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = {"host": socket.gethostname(), "pid": int(gone.stdout), "pidns": pidns}
    with renewed(storage, record(0, ttl=1.0, **here)):
        with pytest.raises(LeaseHeldError, match=f"on host {socket.gethostname()} pid {here['pid']}"):
            Lease(storage, ttl_s=1.0).acquire()
    storage.delete([LEASE])
    storage.put_conditional(LEASE, record(-10, ttl=0.6, **here).to_bytes(), token=None)
    assert acquire_timed(Lease(storage, ttl_s=30)) >= 0.6


def test_a_live_record_from_the_future_is_refused_with_its_holder_named_and_no_negative_age(storage):
    with renewed(storage, record(1e9, ttl=1.0)):
        with pytest.raises(LeaseHeldError) as e:
            Lease(storage, ttl_s=1.0).acquire()
    message = str(e.value)
    assert "run run-b on host other-host pid 4242" in message and "its clock 1000000000 s ahead" in message
    assert not re.search(r"-[0-9]", message.split(": ", 1)[1]), message


def test_a_dead_record_from_the_future_blocks_for_its_ttl_not_for_the_skew(storage):
    storage.put_conditional(LEASE, record(1e9, ttl=0.5).to_bytes(), token=None)
    assert 0.5 <= acquire_timed(Lease(storage, ttl_s=30)) < 30


def newer_record(**fields) -> bytes:
    doc = {"format": "spotguard-lease/2", "run_id": "run-n", "host": "new-host", "pid": 77, "lease": {"v": 2}}
    return json.dumps({**doc, **fields}).encode()


def test_a_record_of_a_newer_format_is_refused_naming_its_holder_unless_taken_over_on_purpose(storage):
    storage.put_conditional(LEASE, newer_record(), token=None)
    with pytest.raises(LeaseHeldError, match="spotguard-lease/2 record, of a newer spotguard") as e:
        Lease(storage).acquire()
    assert "run_id 'run-n', host 'new-host', pid 77" in str(e.value) and "upgrade spotguard" in str(e.value)
    assert storage.get_bytes(LEASE) == newer_record()
    mine = Lease(storage, takeover=True, takeover_grace_s=0)
    mine.acquire()
    assert record_mod.read(storage).owner == mine.owner
    mine.release()


HUGE = 10**400  # JSON allows it; as a float it overflows


@pytest.mark.parametrize("field", ["renewed_at", "acquired_at", "ttl_s"])
def test_a_number_past_any_float_makes_a_record_corrupt_never_a_traceback(storage, field):
    doc = json.loads(record(0, ttl=30).to_bytes())
    data = json.dumps({**doc, field: HUGE}).encode()
    with pytest.raises(CheckpointCorruptError, match="bad field"):
        LeaseRecord.from_bytes(data)
    # A holder whose record is replaced by it: its heartbeat and its fence say the lease is lost.
    lost = threading.Event()
    holder = Lease(storage, ttl_s=0.3, on_lost=lambda why: lost.set())
    holder.acquire()
    _, token = storage.get_versioned(LEASE)
    storage.put_conditional(LEASE, data, token=token)
    assert lost.wait(10), "the heartbeat died instead of noticing"
    with pytest.raises(LeaseLostError, match="its record was replaced"):
        holder.fence()
    holder.release()  # never raises
    taker = Lease(storage, ttl_s=30)  # corrupt: taken over, as any corrupt record
    taker.acquire()
    taker.release()


def test_rm_incomplete_refuses_a_record_with_a_huge_number_in_one_line(storage, tmp_path):
    doc = json.loads(record(0, ttl=30).to_bytes())
    storage.put_bytes(LEASE, json.dumps({**doc, "renewed_at": HUGE}).encode())
    storage.put_bytes("step-00000001/state.pt", b"killed save")
    out = subprocess.run(
        [sys.executable, "-m", "spotguard", "rm", str(tmp_path / "run"), "--incomplete", "--min-age", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "bad field" in out.stderr and "nothing deleted" in out.stderr, out.stderr
    assert storage.get_bytes("step-00000001/state.pt") == b"killed save"
