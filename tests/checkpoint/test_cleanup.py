"""``checkpoint.cleanup``: which garbage may go, judged on a local folder with injected clocks."""

from __future__ import annotations

import os
import socket
import time

import pytest

from spotguard import checkpoint
from spotguard.checkpoint import cleanup
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
        cleanup.remove(st, c)
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
