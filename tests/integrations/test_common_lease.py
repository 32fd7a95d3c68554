"""The writer lease of the trainer integrations' checkpoint folders (``FolderCheckpoints``): another
job's record is written straight into the storage, as a job on another machine would."""

from __future__ import annotations

import time

import pytest

from spotguard import checkpoint, heartbeat
from spotguard.checkpoint import lease as lease_record
from spotguard.errors import LeaseHeldError, LeaseLostError
from spotguard.integrations._common import watch_parts
from spotguard.integrations._folders import FolderCheckpoints
from spotguard.storage import open_storage

from ..helpers import azure_approvals_read_the_lease, wait_until
from .test_common import trainer_folder


def other_writer(storage, token=None) -> lease_record.LeaseRecord:
    now = time.time()
    other = lease_record.LeaseRecord("run-b", "other-host", 4242, now - 30, now, 600.0, owner="b" * 16)
    storage.put_conditional(lease_record.LEASE, other.to_bytes(), token=token)
    return other


def test_a_live_lease_of_another_job_stops_the_resume_and_the_commit(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    other_writer(storage)
    ckpts = FolderCheckpoints(storage, work_dir=str(tmp_path / "work"))
    with pytest.raises(LeaseHeldError, match="host other-host pid 4242, holding for 30 s"):
        ckpts.newest_verified()
    with pytest.raises(LeaseHeldError):
        ckpts.commit(10, trainer_folder(tmp_path / "out", 10), "periodic")
    assert checkpoint.scan(storage) == []
    assert ckpts._beat.flags & heartbeat.LEASE_HELD


def test_a_job_whose_lease_was_taken_over_commits_nothing_more(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    ckpts = FolderCheckpoints(storage, keep=5)
    assert ckpts.commit(10, trainer_folder(tmp_path / "out", 10), "periodic") is not None
    _, token = storage.get_versioned(lease_record.LEASE)
    other_writer(storage, token)  # taken over on purpose by a job elsewhere
    with pytest.raises(LeaseLostError, match="now held by run run-b on host other-host"):
        ckpts.commit(20, trainer_folder(tmp_path / "out", 20), "periodic")
    assert [i.step for i in checkpoint.scan(storage) if i.complete] == [10]
    assert ckpts._beat.flags & heartbeat.LEASE_HELD


def test_the_stops_last_checkpoint_releases_the_lease_for_the_replacement(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    ckpts, notices = watch_parts(storage, {"providers": []})
    ckpts.commit(10, trainer_folder(tmp_path / "out", 10), "periodic")
    assert not lease_record.read(storage).released
    ckpts.commit(11, trainer_folder(tmp_path / "out", 11), "emergency")
    assert not notices.stop_saved(11, save_s=0.1)  # "stop": the emergency checkpoint is the last
    assert lease_record.read(storage).released


def test_the_stops_approval_goes_out_once_the_lease_is_released(tmp_path, monkeypatch):
    # Azure may evict the machine as soon as its Preempt event is approved: a lease still held then
    # keeps the replacement waiting for its TTL. The mock IMDS over real HTTP; the lease is read when
    # the approval goes out.
    storage = open_storage(str(tmp_path / "ckpt"))
    with azure_approvals_read_the_lease(storage, tmp_path, monkeypatch) as (provider, sender, released):
        ckpts, notices = watch_parts(storage, {"providers": [provider], "interval": 0.05})
        notices.start()
        try:
            ckpts.commit(10, trainer_folder(tmp_path / "out", 10), "periodic")
            sender.send(None)  # type: ignore[arg-type]
            wait_until(notices.preempted.is_set, "the Preempt event was never seen")
            ckpts.commit(11, trainer_folder(tmp_path / "out", 11), "emergency")
            assert not notices.stop_saved(11, save_s=0.1)
        finally:
            notices.stop()
        assert released == [True] and sender.approvals() == 1
