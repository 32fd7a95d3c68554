"""The writer lease between two real jobs on S3 (moto server), GCS and Azure Blob (Azurite): a second
job is refused at once, and a takeover stops the first (the scenario of ``tests/guard/test_lease.py``).

GCS runs on fake-gcs-server: it applies generation preconditions to simple uploads, the lease's
writes; gcp-storage-emulator ignores ``if_generation_match``, so both jobs would hold the lease there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.guard.test_lease import refused_then_taken_over

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("fixture", ["s3_url", "fake_gcs_url", "az_url"])
def test_a_second_job_is_refused_and_a_takeover_stops_the_first(fixture: str, request, tmp_path: Path):
    refused_then_taken_over(str(request.getfixturevalue(fixture)), tmp_path)
