"""The writer lease between two real jobs on S3 (moto server), GCS and Azure Blob (Azurite): a second
job is refused at once, and a takeover stops the first (the scenario of ``tests/guard/test_lease.py``).

GCS runs on fake-gcs-server: it applies generation preconditions to simple uploads, the lease's
writes; gcp-storage-emulator ignores ``if_generation_match``, so both jobs would hold the lease there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.checkpoint import lease as lease_record
from spotguard.checkpoint.lease import LEASE
from spotguard.checkpoint.leaseholder import Lease
from spotguard.errors import LeaseHeldError
from spotguard.storage import open_storage
from tests.checkpoint.test_lease_clocks import acquire_timed, record, renewed
from tests.guard.test_lease import forked_jobs, refused_then_taken_over  # noqa: F401  (an autouse fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("fixture", ["s3_url", "fake_gcs_url", "az_url"])
def test_a_second_job_is_refused_and_a_takeover_stops_the_first(fixture: str, request, tmp_path: Path):
    refused_then_taken_over(str(request.getfixturevalue(fixture)), tmp_path)


@pytest.mark.parametrize("fixture", ["s3_url", "fake_gcs_url", "az_url"])
def test_expiry_is_judged_by_watching_the_record_on_each_backend(fixture: str, request):
    """The watch compares the service's version tokens (ETag, generation): a holder whose clock is 120 s
    behind and who renews is refused; once it stops, its record is taken over after its TTL, not before."""
    storage = open_storage(str(request.getfixturevalue(fixture)))
    with renewed(storage, record(-120, ttl=1.5), every=0.2):
        with pytest.raises(LeaseHeldError, match="renewed its lease while this job watched"):
            Lease(storage, ttl_s=1.5).acquire()
    assert lease_record.read(storage).owner == "b" * 16
    storage.delete([LEASE])
    storage.put_conditional(LEASE, record(-120, ttl=1.0).to_bytes(), token=None)
    assert acquire_timed(Lease(storage, ttl_s=30)) >= 1.0
