"""S3 specifics against moto's server: multipart with a full-object CRC32, integrity on read,
fail-fast permanent errors, deadline-bounded retries, and no trace on the global random streams."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import boto3
import pytest

from spotguard import checkpoint
from spotguard.errors import CheckpointCorruptError, StorageAccessError, StorageError
from spotguard.storage import open_storage
from spotguard.storage.retry import RetryOptions
from spotguard.storage.s3 import S3Options, S3Storage
from tests.faultproxy import FaultProxy

MiB = 1 << 20
FAST_RETRY = RetryOptions(attempts=3, initial=0.01, maximum=0.05)


def corrupt_in_moto(bucket: str, key: str) -> None:
    """Flip one byte of a stored object inside moto, leaving its stored checksum as it was."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, key)
    data = bytearray(obj.value)
    data[len(data) // 2] ^= 0xFF
    obj.value = bytes(data)


def parts_stored(st: S3Storage) -> threading.Event:
    """Set once the server has acknowledged a part (an UploadPart answered 200) through ``st``'s client.

    Seen from the client, not by polling ``list_parts``: moto computes a part's ETag lazily, without
    its lock, from a buffer it shares with the UploadPart answer, so listing parts while they land
    can store a wrong ETag and fail the upload's completion with InvalidPart (seen once in CI).
    """
    stored = threading.Event()

    def answered(http_response, **kw) -> None:
        if http_response.status_code == 200:
            stored.set()

    st.client.meta.events.register("after-call.s3.UploadPart", answered)
    return stored


def test_url_and_standard_chain_are_used(s3_url: str):
    st = open_storage(s3_url)  # AWS_ENDPOINT_URL and keys come from the environment
    assert isinstance(st, S3Storage) and st.bucket.startswith("t-") and st.prefix == "run/"
    st.put_bytes("k", b"v")
    assert boto3.client("s3").get_object(Bucket=st.bucket, Key="run/k")["Body"].read() == b"v"


def test_large_objects_go_multipart_with_full_object_crc(s3_url: str, tmp_path):
    """A finished file (a local tier's, uploaded later) goes up with the full-object CRC32 its writer kept."""
    st = S3Storage(s3_url, S3Options(part_size=5 * MiB, multipart_threshold=5 * MiB, concurrency=4))
    seen = []
    st.progress = seen.append
    (tmp_path / "state.pt").write_bytes(os.urandom(12 * MiB))
    st.put_file("step-00000001/state.pt", tmp_path / "state.pt")
    head = st.client.head_object(Bucket=st.bucket, Key="run/step-00000001/state.pt", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    assert head["ChecksumType"] == "FULL_OBJECT" and head["ChecksumCRC32"]
    assert sum(seen) == 12 * MiB  # progress callbacks saw every byte


def test_corrupted_object_is_caught_on_read_and_resume_falls_back(s3_url: str):
    st = open_storage(s3_url)
    for step in (1, 2):
        checkpoint.write(st, step, {"state.pt": lambda f: f.write(os.urandom(100_000))}, reason="periodic")
    corrupt_in_moto(st.bucket, "run/step-00000002/state.pt")
    with pytest.raises(CheckpointCorruptError, match="CRC32"):
        with st.local_copy("step-00000002/state.pt"):
            pass
    infos = checkpoint.scan(st)
    with pytest.raises(CheckpointCorruptError):
        checkpoint.verify(st, infos[1])
    checkpoint.verify(st, infos[0])  # the older one still verifies


def test_permanent_errors_fail_fast_naming_bucket_key_and_fix(s3_env):
    bucket = "t-" + os.urandom(4).hex()
    boto3.client("s3").create_bucket(Bucket=bucket)
    with FaultProxy(s3_env.port, rate=1.0, faults=("403",)) as proxy:
        st = S3Storage(f"s3://{bucket}/run", S3Options(endpoint_url=proxy.url))
        t0 = time.monotonic()
        with pytest.raises(StorageError) as err:
            st.put_bytes("step-00000001/manifest.json", b"{}")
        assert time.monotonic() - t0 < 10 and proxy.requests == 1  # not retried (a retry would be a 2nd request)
    msg = str(err.value)
    assert f"s3://{bucket}/run/step-00000001/manifest.json" in msg and "credentials" in msg
    assert isinstance(err.value, StorageAccessError)  # permanent: `spotguard run` exits 78, no restart
    missing = S3Storage("s3://no-such-bucket-here/x")
    with pytest.raises(StorageAccessError, match="bucket 'no-such-bucket-here' does not exist; create it"):
        missing.list()


def test_retries_stop_at_the_callers_deadline(s3_url: str, moto):
    bucket = S3Storage(s3_url).bucket
    with FaultProxy(moto.port, rate=1.0, faults=("503",)) as proxy:
        st = S3Storage(
            f"s3://{bucket}/run",
            S3Options(
                endpoint_url=proxy.url, retry=RetryOptions(attempts=100, initial=0.2, maximum=0.4, max_elapsed=60)
            ),
        )
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="gave up after retries"):
            st.put_bytes("m", b"x", deadline=t0 + 1.5)
        took = time.monotonic() - t0
    assert 0.3 < took < 3.0, took  # retried, and given up at the deadline (1.5 s; slack for a busy 2-core box)
    assert proxy.requests >= 3


@pytest.mark.parametrize("fault", ["503", "403"])
def test_failed_multipart_uploads_raise_storage_errors(s3_url: str, moto, fault: str):
    """boto3 wraps a failed part in S3UploadFailedError: it must still be retried (5xx) or fail fast
    (403), and reach the caller as a StorageError (what Guard catches to keep training)."""
    bucket = S3Storage(s3_url).bucket
    with FaultProxy(moto.port) as proxy:
        st = S3Storage(
            f"s3://{bucket}/run",
            S3Options(
                endpoint_url=proxy.url,
                part_size=5 * MiB,
                multipart_threshold=5 * MiB,
                request_attempts=2,
                retry=RetryOptions(attempts=3, initial=0.01, maximum=0.02),
            ),
        )
        with pytest.raises(StorageError) as err:
            with st.open_write("step-00000001/state.pt") as f:
                f.write(os.urandom(6 * MiB))
                proxy.rate, proxy.faults = 1.0, (fault,)  # from now on (the upload) every request fails
    starts = sum("uploads" in r and r.startswith("POST") for r in proxy.log)  # CreateMultipartUpload
    if fault == "503":
        assert "gave up after retries" in str(err.value) and starts == 3 * 2  # operations x request tries
    else:
        assert "credentials" in str(err.value) and starts == 1


def test_transient_faults_are_retried_without_touching_global_random(s3_url: str, moto, caplog):
    """30% of requests fail (drops, 5xx, resets, truncated replies) while a background thread saves."""
    bucket = S3Storage(s3_url).bucket
    random.seed(1234)
    before = random.getstate()
    with FaultProxy(moto.port, rate=0.3, faults=("drop", "500", "503", "reset", "truncate"), seed=7) as proxy:
        st = S3Storage(
            f"s3://{bucket}/run",
            S3Options(
                endpoint_url=proxy.url,
                part_size=5 * MiB,
                multipart_threshold=5 * MiB,
                retry=FAST_RETRY,
                request_attempts=6,
            ),
        )
        data = os.urandom(11 * MiB)
        errors: list[BaseException] = []

        def save() -> None:
            try:
                with st.open_write("step-00000001/state.pt") as f:
                    f.write(data)
                st.put_bytes("step-00000001/manifest.json", b"{}", exclusive=True)
                with st.local_copy("step-00000001/state.pt") as path:
                    assert path.read_bytes() == data
                assert st.list("") == ["step-00000001/manifest.json", "step-00000001/state.pt"]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        with caplog.at_level(logging.WARNING):
            t = threading.Thread(target=save)
            t.start()
            t.join(120)
        assert not errors, errors
        assert random.getstate() == before  # no retry jitter, no temp names drawn from `random`
    assert sum(proxy.injected.values()) >= 3, proxy.injected


def test_an_emergency_deadline_does_not_cut_short_a_concurrent_background_upload(s3_url: str, moto):
    """A periodic save retries 503s (no deadline) while an emergency upload with a deadline that has
    all but passed runs beside it on the same storage and is abandoned at that deadline: the
    periodic save keeps retrying and lands."""
    bucket = S3Storage(s3_url).bucket
    with FaultProxy(moto.port, rate=1.0, faults=("503",), only="/run/periodic") as proxy:
        # attempts=1: only the per-request hook retries, the layer that reads the deadline.
        st = S3Storage(
            f"s3://{bucket}/run",
            S3Options(
                endpoint_url=proxy.url,
                part_size=5 * MiB,
                multipart_threshold=5 * MiB,
                request_attempts=1000,
                retry=RetryOptions(attempts=1, initial=0.01, maximum=0.02),
            ),
        )
        errors: list[BaseException] = []

        def periodic() -> None:
            try:
                st.put_bytes("periodic/manifest.json", b"{}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=periodic)
        t.start()
        until = time.monotonic() + 20
        while proxy.injected["503"] < 3:
            assert time.monotonic() < until, "the periodic save never reached the server"
            time.sleep(0.01)
        with pytest.raises(StorageError, match="deadline"):  # about 0.5 s of multipart work, 0.01 s left
            with st.open_write("emergency/state.pt", deadline=time.monotonic() + 0.01) as f:
                f.write(os.urandom(20 * MiB))
        before = proxy.injected["503"]
        time.sleep(0.5)
        retried = proxy.injected["503"] - before  # the periodic save went on retrying, past that deadline
        proxy.rate = 0.0
        t.join(30)
        assert not errors, errors
        assert st.get_bytes("periodic/manifest.json") == b"{}" and retried > 0


def test_a_background_operation_does_not_lift_a_concurrent_emergency_deadline(s3_url: str, moto):
    """An emergency write retries 503s until its deadline while other operations start and finish
    on the same storage: it still gives up at its deadline."""
    bucket = S3Storage(s3_url).bucket
    with FaultProxy(moto.port, rate=1.0, faults=("503",), only="/run/emergency") as proxy:
        st = S3Storage(
            f"s3://{bucket}/run",
            S3Options(
                endpoint_url=proxy.url,
                request_attempts=1000,
                retry=RetryOptions(attempts=1, initial=0.01, maximum=0.02),
            ),
        )
        outcome: list[BaseException | float] = []

        def emergency() -> None:
            t0 = time.monotonic()
            try:
                st.put_bytes("emergency/manifest.json", b"{}", deadline=t0 + 1.0)
            except StorageError as e:
                outcome.append(e)
            outcome.append(time.monotonic() - t0)

        t = threading.Thread(target=emergency)
        t.start()
        for i in range(50):
            st.put_bytes(f"periodic/{i}", b"x")
            if not t.is_alive():
                break
        t.join(5)
        given_up = proxy.injected["503"]
        time.sleep(0.5)
        retried_after = proxy.injected["503"] - given_up  # a lifted deadline would go on retrying
        proxy.rate = 0.0  # lets the old, deadline-less retries end
        t.join(30)
    assert isinstance(outcome[0], StorageError), outcome
    assert outcome[1] < 1.5, outcome
    assert retried_after <= 1, retried_after  # at most one request already in flight


def test_a_save_straight_to_s3_uploads_parts_while_its_file_is_still_being_written(s3_url: str):
    """The sum of disk and network becomes their maximum: a part is on S3 before the writer has finished."""
    st = open_storage(s3_url)
    stored = parts_stored(st)
    overlapped: list[bool] = []

    def writer(f) -> None:
        f.write(os.urandom(40 * MiB))  # two 16 MiB buffers land: one 32 MiB part can go
        overlapped.append(stored.wait(60))  # a part on S3 while the file is still being written
        f.write(os.urandom(MiB))

    checkpoint.write(st, 1, {"state.pt": writer}, reason="emergency")
    assert overlapped == [True]
    (info,) = checkpoint.scan(st)
    assert info.complete and info.manifest.files[0].size == 41 * MiB
    checkpoint.verify(st, info)  # the object is the file the writer wrote, byte for byte


def test_open_write_uploads_parts_while_the_stream_is_still_written(s3_url: str):
    """What DCP shards and rank files use: parts go up as the spool grows, the object is what was written."""
    st = S3Storage(s3_url, S3Options(part_size=5 * MiB, multipart_threshold=5 * MiB, concurrency=4))
    data = os.urandom(45 * MiB)
    stored = parts_stored(st)
    with st.open_write("step-00000001/shards/rank-00000.distcp") as f:
        f.write(data[: 33 * MiB])  # reported to the upload every 16 MiB: three 10 MiB parts can go
        overlapped = stored.wait(60)
        f.write(data[33 * MiB :])
    assert overlapped
    with st.local_copy("step-00000001/shards/rank-00000.distcp") as path:
        assert path.read_bytes() == data


def test_open_write_that_raises_stores_nothing_and_leaves_no_upload(s3_url: str):
    st = S3Storage(s3_url, S3Options(part_size=5 * MiB, multipart_threshold=5 * MiB, concurrency=4))
    with pytest.raises(RuntimeError, match="rank died"):
        with st.open_write("step-00000001/shards/rank-00000.distcp") as f:
            f.write(os.urandom(40 * MiB))
            raise RuntimeError("rank died")
    assert st.list("step-00000001/") == []
    deadline = time.monotonic() + 10  # the upload thread aborts its multipart upload as it stops
    while st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads")
