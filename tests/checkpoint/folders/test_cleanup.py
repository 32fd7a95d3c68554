"""``checkpoint.folders.cleanup``: which garbage may go, judged on a local folder with injected clocks."""

from __future__ import annotations

import os
import socket
import time

import pytest

from spotguard import checkpoint
from spotguard.checkpoint.folders import cleanup
from spotguard.checkpoint.lease import LEASE, LeaseRecord
from spotguard.errors import ConfigError
from spotguard.storage import open_storage


def test_age_counts_from_the_newest_change_in_a_checkpoint_folder(tmp_path):
    st = open_storage(str(tmp_path))
    st.put_bytes("step-00000007/state.pt", b"killed save")
    then = time.time() - 7200
    os.utime(tmp_path / "step-00000007" / "state.pt", (then, then))
    (tmp_path / "step-00000007" / f"rank1.pt.tmp-{socket.gethostname()}@999999-0123abcd").write_bytes(b"x")
    found = cleanup.plan(st)  # a file written just now in the folder: a save may still be filling it
    assert found.garbage == [] and len(found.skipped) == 2
    later = cleanup.plan(st, now=time.time() + 3600)
    assert sorted(c.kind for c in later.garbage) == ["incomplete", "temp file"]
    for c in later.garbage:
        assert cleanup.remove(st, c, later) == ""
    assert not (tmp_path / "step-00000007").exists()


def test_a_temp_file_of_a_writer_still_running_here_is_kept(tmp_path):
    st = open_storage(str(tmp_path))
    (tmp_path / "step-00000003").mkdir()
    mine = tmp_path / "step-00000003" / f"state.pt.tmp-{socket.gethostname()}@{os.getpid()}-0123abcd"
    mine.write_bytes(b"being written")
    found = cleanup.plan(st, 0)
    ((c, why),) = found.skipped
    assert (
        c.kind == "temp file"
        and why == f"its writer ({socket.gethostname()}@{os.getpid()}) is still running on this host"
    )


def test_a_lease_renewed_too_long_ago_protects_nothing(tmp_path):
    st = open_storage(str(tmp_path))
    checkpoint.write(st, 1, {"state.pt": lambda f: f.write(b"x")}, reason="periodic")
    st.put_bytes("step-00000002/state.pt", b"killed save")
    now = time.time()
    expired = LeaseRecord("run-a", "gone", 1, acquired_at=now - 900, renewed_at=now - 300, ttl_s=60)
    st.put_bytes(LEASE, expired.to_bytes())
    found = cleanup.plan(st, 0)
    assert found.live_lease is None and [c.name for c in found.garbage] == ["step-00000002"]
    st.put_bytes(LEASE, LeaseRecord("run-a", "here", 1, acquired_at=now, renewed_at=now, ttl_s=60).to_bytes())
    found = cleanup.plan(st, 0)
    assert found.garbage == [] and found.live_lease is not None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True])
def test_min_age_must_be_a_finite_number_of_seconds(tmp_path, bad):
    with pytest.raises(ConfigError, match="min_age_s"):
        cleanup.plan(open_storage(str(tmp_path)), bad)


def _killed_save(st, root, step: int) -> None:
    """What a save killed two hours ago left of ``step``: a file, no manifest."""
    st.put_bytes(f"step-{step:08d}/state.pt", b"killed save")
    then = time.time() - 7200
    for p in [root / f"step-{step:08d}", root / f"step-{step:08d}" / "state.pt"]:
        os.utime(p, (then, then))


def _commit(st, step: int, data: bytes = b"committed") -> None:
    checkpoint.write(st, step, {"state.pt": lambda f: f.write(data)}, reason="periodic")


@pytest.mark.parametrize("files_old", [False, True])
def test_a_step_committed_between_the_plan_and_the_removal_is_kept(tmp_path, files_old):
    st = open_storage(str(tmp_path))
    _killed_save(st, tmp_path, 5)
    found = cleanup.plan(st)
    (c,) = found.garbage
    assert c.name == "step-00000005" and c.kind == "incomplete"
    _commit(st, 5)  # a job resumed and saved step 5 meanwhile (no lease: an older spotguard, or none taken)
    if files_old:  # its files as old as the killed save's: only the manifest tells them apart
        then = time.time() - 7200
        for p in (tmp_path / "step-00000005").iterdir():
            os.utime(p, (then, then))
    why = cleanup.remove(st, c, found)
    assert why == ("it holds a manifest now: committed since the plan" if files_old else why) and why
    (info,) = checkpoint.scan(st)
    assert info.complete
    checkpoint.verify(st, info)


def test_a_lease_taken_between_the_plan_and_the_removal_keeps_everything(tmp_path):
    from spotguard.checkpoint.leaseholder import Lease

    st = open_storage(str(tmp_path))
    _killed_save(st, tmp_path, 5)
    _killed_save(st, tmp_path, 6)
    found = cleanup.plan(st)
    assert [c.name for c in found.garbage] == ["step-00000005", "step-00000006"]
    lease = Lease(st, ttl_s=30)
    lease.acquire()  # a job starts: it will clear and write step 5 or 6 any moment now
    try:
        for c in found.garbage:
            assert cleanup.remove(st, c, found).startswith("the writer lease changed since the plan (run ")
    finally:
        lease.release()
    assert (tmp_path / "step-00000005" / "state.pt").exists() and (tmp_path / "step-00000006" / "state.pt").exists()


def test_a_folder_written_to_since_the_plan_is_kept(tmp_path):
    st = open_storage(str(tmp_path))
    _killed_save(st, tmp_path, 5)
    found = cleanup.plan(st)
    st.put_bytes("step-00000005/rank1.pt", b"a save of step 5 is writing")
    why = cleanup.remove(st, found.garbage[0], found)
    assert why == "step-00000005 changed 0s ago, since the plan: a save may be writing it", why
    assert (tmp_path / "step-00000005" / "state.pt").exists()


def test_a_broken_checkpoint_mended_since_the_plan_is_kept(tmp_path):
    st = open_storage(str(tmp_path))
    _commit(st, 5, b"first")
    (tmp_path / "step-00000005" / "state.pt").unlink()
    then = time.time() - 7200
    os.utime(tmp_path / "step-00000005" / "manifest.json", (then, then))
    found = cleanup.plan(st)
    (c,) = found.garbage
    assert c.kind == "broken"
    (tmp_path / "step-00000005" / "manifest.json").unlink()
    _commit(st, 5, b"again")  # saved again, whole
    for p in (tmp_path / "step-00000005").iterdir():
        os.utime(p, (then, then))
    assert cleanup.remove(st, c, found) == "it is complete now, no longer broken"
    assert checkpoint.scan(st)[0].complete
