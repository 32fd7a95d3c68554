"""GCS specifics: the global random streams stay untouched, CRC32C is sent and checked, write-once
manifests, integrity on read, fail-fast errors. Each test names the emulator it needs and why."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import google.api_core.exceptions as gexc
import google_crc32c
import pytest

from spotguard import checkpoint
from spotguard.errors import CheckpointCorruptError, StorageAccessError, StorageError
from spotguard.storage import open_storage
from spotguard.storage._common import crc_b64
from spotguard.storage.gcs import GCSOptions, GCSStorage
from spotguard.storage.retry import RetryOptions
from tests.faultproxy import FaultProxy
from tests.helpers import subprocess_env

MiB = 1 << 20


def test_library_alone_draws_from_global_random(fake_gcs_url: str):
    """The control for the next test: a plain multipart upload shifts Python's global random stream.

    fake-gcs-server: any emulator would do; this one is fast.
    """
    bucket = fake_gcs_url.split("/")[2]
    code = (
        "import random\nfrom google.cloud import storage\nbefore = random.getstate()\n"
        f"storage.Client().bucket({bucket!r}).blob('plain').upload_from_string(b'{{}}')\n"
        "print(random.getstate() != before)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )  # a fresh process: spotguard (and its fix) not imported
    assert out.stdout.strip() == "True", out.stderr


def test_importing_the_backend_leaves_the_google_library_untouched(fake_gcs_url: str):
    """Only an upload installs the private MIME boundary, once, however many threads upload at once.

    fake-gcs-server: the uploads are plain multipart ones.
    """
    code = (
        "import threading\nfrom google.cloud.storage._media import _upload\noriginal = _upload.get_boundary\n"
        "import spotguard.storage.gcs as g\nprint(_upload.get_boundary is original)\n"
        f"st = g.GCSStorage({fake_gcs_url!r})\n"
        "ts = [threading.Thread(target=st.put_bytes, args=(f'k{i}', b'x')) for i in range(4)]\n"
        "[t.start() for t in ts]\n[t.join() for t in ts]\nfirst = _upload.get_boundary\n"
        "st.put_bytes('again', b'y')\n"
        "print(first is not original, _upload.get_boundary is first, sorted(st.list()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )  # a fresh process: nothing imported or patched yet
    assert out.stdout.splitlines() == ["True", "True True ['again', 'k0', 'k1', 'k2', 'k3']"], out.stderr


@pytest.mark.parametrize("fault_rate", [0.0, 0.3])
def test_saves_leave_global_random_untouched_also_from_background_threads(
    fake_gcs, fake_gcs_url: str, monkeypatch, fault_rate: float
):
    """Composite, resumable and multipart uploads, reads and listing, from a worker thread, also
    while 30% of requests fail (retries, and the library's own background metadata fetches).

    fake-gcs-server: it enforces if_generation_match, so the write-once path runs as in production.
    """
    proxy = FaultProxy(fake_gcs.port, rate=fault_rate, faults=("drop", "500", "503", "reset"), seed=4).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    # state.pt (3 MiB): parallel parts + compose; extra.bin (1.5 MiB): resumable; manifest: multipart.
    st = GCSStorage(
        fake_gcs_url,
        GCSOptions(
            chunk_size=MiB,
            resumable_threshold=MiB,
            composite_threshold=2 * MiB,
            retry=RetryOptions(attempts=10, initial=0.01, maximum=0.05),
        ),
    )
    random.seed(99)
    before = random.getstate()
    errors: list[BaseException] = []

    def save() -> None:
        try:
            checkpoint.write(
                st,
                5,
                {
                    "state.pt": lambda f: f.write(os.urandom(3 * MiB)),
                    "extra.bin": lambda f: f.write(os.urandom(3 * MiB // 2)),
                },
                reason="periodic",
            )
            info = checkpoint.latest(st)
            assert info is not None
            checkpoint.verify(st, info)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        t = threading.Thread(target=save)
        t.start()
        t.join(60)
        time.sleep(0.5)  # give stray background threads of the library time to draw, if any
    finally:
        proxy.stop()
    assert not errors, errors
    assert random.getstate() == before
    assert fault_rate == 0 or sum(proxy.injected.values()) >= 2, proxy.injected


def test_crc32c_is_sent_and_held_by_the_server(gcp_emulator_url: str):
    """gcp-storage-emulator: it checks the CRC32C sent with an upload, as GCS does."""
    st = GCSStorage(gcp_emulator_url, GCSOptions(chunk_size=MiB, resumable_threshold=MiB))
    data = os.urandom(2 * MiB + 17)
    with st.open_write("big") as f:
        f.write(data)
    st.put_bytes("small", b"manifest")
    for key, content in (("big", data), ("small", b"manifest")):
        blob = st.bucket.get_blob("run/" + key)
        assert blob.crc32c == crc_b64(int(google_crc32c.value(content)))
    bad = st.bucket.blob("run/forged")
    bad.crc32c = crc_b64(int(google_crc32c.value(b"other")))
    with pytest.raises(gexc.BadRequest, match="CRC32C"):  # the server refuses an upload whose CRC32C does not match
        bad.upload_from_string(b"manifest", retry=None, checksum=None)


def test_corrupted_object_is_caught_on_read_and_resume_falls_back(gcp_emulator_url: str, gcp_emulator):
    """gcp-storage-emulator: it keeps objects as plain files, so the test can corrupt one at rest."""
    st = open_storage(gcp_emulator_url)
    for step in (1, 2):
        checkpoint.write(st, step, {"state.pt": lambda f: f.write(os.urandom(100_000))}, reason="periodic")
    bucket = gcp_emulator_url.split("/")[2]
    stored = gcp_emulator.root / bucket / "run" / "step-00000002" / "state.pt"
    data = bytearray(stored.read_bytes())
    data[500] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="CRC32C"):
        with st.local_copy("step-00000002/state.pt"):
            pass
    infos = checkpoint.scan(st)
    with pytest.raises(CheckpointCorruptError):
        checkpoint.verify(st, infos[1])
    checkpoint.verify(st, infos[0])


def test_permanent_errors_fail_fast_naming_bucket_key_and_fix(fake_gcs, monkeypatch):
    """fake-gcs-server behind the fault proxy answering 403 to everything."""
    with FaultProxy(fake_gcs.port, rate=1.0, faults=("403",)) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        st = GCSStorage("gs://some-bucket/run")
        with pytest.raises(StorageError) as err:
            st.put_bytes("step-00000001/manifest.json", b"{}")
        # not retried (the library itself follows a failed upload with one bucket lookup)
        assert sum("uploadType" in r for r in proxy.log) == 1, proxy.log
    msg = str(err.value)
    assert "gs://some-bucket/run/step-00000001/manifest.json" in msg and "credentials" in msg
    assert isinstance(err.value, StorageAccessError)  # permanent: `spotguard run` exits 78, no restart
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)
    with pytest.raises(StorageAccessError, match="bucket 'no-such-bucket' does not exist; create it"):
        GCSStorage("gs://no-such-bucket/x").list()


@pytest.mark.parametrize("emulator", ["fake_gcs_url", "gcp_emulator_url"])
def test_large_objects_upload_as_parallel_parts_then_compose(emulator, request):
    """Both emulators: fake-gcs-server for speed, gcp-storage-emulator because it checks each part's CRC32C."""
    st = GCSStorage(
        request.getfixturevalue(emulator), GCSOptions(chunk_size=MiB, composite_threshold=2 * MiB, concurrency=3)
    )
    seen: list[int] = []
    st.progress = seen.append
    data = os.urandom(3 * MiB + 5)
    with st.open_write("step-00000001/state.pt") as f:
        f.write(data)
    assert sum(seen) == len(data) and len(seen) == 4  # four parts
    blob = st.bucket.get_blob("run/step-00000001/state.pt")
    assert blob.crc32c == crc_b64(int(google_crc32c.value(data)))
    assert [b.name for b in st.bucket.list_blobs()] == ["run/step-00000001/state.pt"]  # parts deleted
    with st.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == data


def test_leftovers_are_the_parts_of_killed_composite_uploads(fake_gcs_url):
    """fake-gcs-server: plain object operations only."""
    st = GCSStorage(fake_gcs_url)
    st.bucket.blob("run/step-00000002/state.pt.sg-part-0123456789ab-00").upload_from_string(b"part")
    st.bucket.blob("run/notes.sg-part-0123456789ab-00").upload_from_string(b"not in a step folder")
    st.put_bytes("step-00000001/state.pt", b"kept")
    assert st.list("") == ["step-00000001/state.pt"]  # parts are invisible
    (item,) = st.leftovers()
    assert (item.key, item.kind, item.size) == ("step-00000002/state.pt.sg-part-0123456789ab-00", "upload part", 4)
    st.remove_leftover(item)
    assert sorted(b.name for b in st.bucket.list_blobs()) == [
        "run/notes.sg-part-0123456789ab-00",
        "run/step-00000001/state.pt",
    ]


@pytest.mark.parametrize("emulator", ["fake_gcs_url", "gcp_emulator_url"])
def test_a_save_straight_to_gcs_uploads_parts_while_its_file_is_written_then_composes_them(emulator, request):
    """The sum of disk and network becomes their maximum; 40 parts compose in two rounds (32 per request),
    and the object's CRC32C is the writer's."""
    st = GCSStorage(
        request.getfixturevalue(emulator), GCSOptions(chunk_size=MiB, composite_threshold=2 * MiB, concurrency=3)
    )
    overlapped = threading.Event()
    data = os.urandom(40 * MiB + 7)

    def writer(f) -> None:
        f.write(data[: 17 * MiB])  # one 16 MiB buffer lands: 16 parts can go
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not overlapped.is_set():
            if any(".sg-part-" in b.name for b in st.bucket.list_blobs()):
                overlapped.set()
            time.sleep(0.05)
        f.write(data[17 * MiB :])

    checkpoint.write(st, 1, {"state.pt": writer}, reason="emergency")
    assert overlapped.is_set()
    blob = st.bucket.get_blob("run/step-00000001/state.pt")
    assert blob.crc32c == crc_b64(int(google_crc32c.value(data)))
    assert sorted(b.name for b in st.bucket.list_blobs()) == [
        "run/step-00000001/manifest.json",
        "run/step-00000001/state.pt",
    ]  # every part and intermediate composite deleted
    (info,) = checkpoint.scan(st)
    checkpoint.verify(st, info)


def test_a_streamed_gcs_upload_of_a_file_damaged_after_it_was_written_is_deleted(fake_gcs_url, monkeypatch):
    from spotguard.storage.growing import GrowingFile

    st = GCSStorage(fake_gcs_url, GCSOptions(chunk_size=MiB, composite_threshold=2 * MiB, concurrency=2))
    real = GrowingFile.finish

    def finish(self, size, crc=None):  # a byte of the last part changes on the disk before the upload reads it
        with open(self.path, "r+b") as f:
            f.seek(size - 10)
            byte = f.read(1)[0] ^ 0x20
            f.seek(size - 10)
            f.write(bytes([byte]))
        real(self, size, crc)

    monkeypatch.setattr(GrowingFile, "finish", finish)
    with pytest.raises(StorageError, match="has CRC32C .*, the file .*: deleted"):
        checkpoint.write(st, 1, {"state.pt": lambda f: f.write(os.urandom(20 * MiB))}, reason="emergency")
    assert list(st.bucket.list_blobs()) == []


def _reads(log: list[str]) -> int:
    return sum(r.startswith("GET") and "alt=media" in r for r in log)


SLICED = GCSOptions(chunk_size=MiB, composite_threshold=2 * MiB, concurrency=3)


def test_a_large_object_comes_down_as_parallel_ranged_reads_checked_as_they_land(fake_gcs_proxied, monkeypatch):
    """fake-gcs-server behind the fault proxy (no faults: it counts the reads). Above the threshold:
    one ranged read per worker, the CRC32C checked as the bytes land (no second pass over the file),
    the global random untouched; below it: one read, then the file's CRC32C."""
    from spotguard.storage import cloud

    url, proxy = fake_gcs_proxied
    large, small = os.urandom(5 * MiB + 3), os.urandom(MiB)
    st = GCSStorage(url, SLICED)
    st.put_bytes("step-00000001/state.pt", large)
    st.put_bytes("step-00000001/small.pt", small)
    passes: list[str] = []
    real_crc = cloud.file_crc
    monkeypatch.setattr(cloud, "file_crc", lambda path, *a: passes.append(path.name) or real_crc(path, *a))
    before = random.getstate()
    with st.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == large
    assert random.getstate() == before  # the library's retries (global-random jitter) stay off
    assert _reads(proxy.log) == 3 and passes == []  # ranges of ceil(size / 3): three reads, checked as they came
    with st.local_copy("step-00000001/small.pt") as path:
        assert path.read_bytes() == small
    assert _reads(proxy.log) == 4 and passes == ["small.pt"]


def test_a_sliced_download_retries_failed_reads_and_the_bytes_are_exact(fake_gcs_proxied):
    """fake-gcs-server behind the fault proxy failing a fifth of the reads (errors, resets, drops)."""
    url, proxy = fake_gcs_proxied
    data = os.urandom(5 * MiB + 3)
    GCSStorage(url).put_bytes("step-00000001/state.pt", data)
    proxy.set_faults(rate=0.2, faults=("500", "503", "reset", "drop"), only="alt=media", seed=3)
    retry = RetryOptions(attempts=12, initial=0.01, maximum=0.05)
    st = GCSStorage(url, GCSOptions(chunk_size=MiB, composite_threshold=2 * MiB, concurrency=3, retry=retry))
    before = random.getstate()
    for _ in range(3):
        with st.local_copy("step-00000001/state.pt") as path:
            assert path.read_bytes() == data
    assert random.getstate() == before
    assert sum(proxy.injected.values()) >= 1 and _reads(proxy.log) > 9, (proxy.injected, _reads(proxy.log))


def test_a_sliced_download_of_a_corrupted_object_is_refused_after_one_more_try(gcp_emulator_url, gcp_emulator, caplog):
    """gcp-storage-emulator: it keeps objects as plain files, so the test can corrupt one at rest."""
    st = GCSStorage(gcp_emulator_url, SLICED)
    st.put_bytes("step-00000001/state.pt", clean := os.urandom(5 * MiB))
    with st.local_copy("step-00000001/state.pt") as path:  # its ranged reads: exact
        assert path.read_bytes() == clean
    stored = gcp_emulator.root / gcp_emulator_url.split("/")[2] / "run" / "step-00000001" / "state.pt"
    data = bytearray(stored.read_bytes())
    data[3 * MiB] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="(?i)crc32c"):
        with st.local_copy("step-00000001/state.pt"):
            pass
    assert caplog.text.count("downloading it again") == 1


def test_every_range_of_a_sliced_download_asks_for_the_generation_it_started_from(fake_gcs_proxied):
    """fake-gcs-server behind the proxy, which sees the requests. GCS refuses a read whose
    ``ifGenerationMatch`` is not the object's: an object replaced mid-download fails it instead of
    mixing two versions' ranges (neither emulator enforces it on reads, so the requests are checked)."""
    url, proxy = fake_gcs_proxied
    st = GCSStorage(url, SLICED)
    st.put_bytes("step-00000001/state.pt", os.urandom(5 * MiB))
    generation = st.bucket.get_blob("run/step-00000001/state.pt").generation
    with st.local_copy("step-00000001/state.pt"):
        pass
    reads = [r for r in proxy.log if r.startswith("GET") and "alt=media" in r]
    assert len(reads) == 3 and all(f"ifGenerationMatch={generation}" in r for r in reads), reads
