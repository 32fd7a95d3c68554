"""Uploads carry the CRC the writer kept while the bytes passed: a file damaged on the local disk
between its write and its upload is refused by a service that checks, and the save fails cleanly.

What each local server enforces (checked here):
- gcp-storage-emulator: refuses an upload whose bytes do not match the CRC32C it was sent, for
  multipart and resumable uploads alike (as GCS does).
- moto (S3): stores the CRC32 it is sent but never refuses a wrong one, so the damaged file is
  stored; the download's check against the CRC32 S3 holds (the writer's) catches it before
  anything loads it (so would the manifest's checksum).
- Azurite (3.37, checked with the real azure-storage-blob client): refuses a Put Block or a Put Blob
  whose body does not match its ``Content-MD5`` (400 ``Md5Mismatch``) or its ``x-ms-content-crc64``
  (400 ``Crc64Mismatch``), as Azure does. We send the per-block digests the writer kept (CRC64 with
  awscrt, else MD5), so the damaged file is refused, for both digests, in one Put Blob or in blocks.
  (Before, the SDK computed each block's MD5 from the bytes it read for the upload: after the damage.)
"""

from __future__ import annotations

import base64
import hashlib
import os
import zlib
from pathlib import Path

import google_crc32c
import pytest
import torch

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.folders import layout
from spotguard.errors import CheckpointCorruptError, StorageError
from spotguard.storage import azure_blocks, cloud, growing, open_storage
from spotguard.storage._common import crc_b64
from spotguard.storage.azure import AzureOptions, AzureStorage
from spotguard.storage.base import Storage
from spotguard.storage.gcs import GCSOptions, GCSStorage
from spotguard.storage.growing import GrowingFile
from spotguard.storage.retry import RetryOptions

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)


def damage_before_upload(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Flip one byte of every file just before it is uploaded (after its checksums were computed): in the
    middle of a file uploaded whole (``put_file``), or in the last part of a file streamed as it is written
    (changed in place as the writer finishes: its earlier parts may be on their way already)."""
    real = storage.put_file
    real_finish = growing.Upload.finish
    damaged: list[str] = []

    def put_file(key: str, path: Path, **kw) -> None:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        path.write_bytes(bytes(raw))
        if key not in damaged:
            damaged.append(key)
        real(key, path, **kw)

    def finish(self, size, crc=None):
        with open(self.file.path, "r+b") as f:  # the last byte: in the last part, read only once finished
            f.seek(size - 1)
            byte = f.read(1)[0] ^ 0x04
            f.seek(size - 1)
            f.write(bytes([byte]))
        damaged.append(self.key)
        real_finish(self, size, crc)

    monkeypatch.setattr(storage, "put_file", put_file)
    monkeypatch.setattr(growing.Upload, "finish", finish)
    return damaged


def write_state(storage: Storage, data: bytes) -> checkpoint.Manifest:
    return layout.write(storage, 1, {"state.pt": lambda f: f.write(data)}, reason="manual")


@pytest.mark.parametrize("size", [MiB // 2, 3 * MiB + 5], ids=["multipart", "resumable"])
def test_gcs_refuses_a_file_damaged_after_its_crc32c_was_computed(gcp_emulator_url, monkeypatch, size):
    st = GCSStorage(
        gcp_emulator_url, GCSOptions(chunk_size=MiB, resumable_threshold=MiB, retry=RetryOptions(attempts=2))
    )
    data = os.urandom(size)
    damaged = damage_before_upload(st, monkeypatch)
    with pytest.raises(StorageError, match="(?i)crc32c"):
        write_state(st, data)
    assert damaged == ["step-00000001/state.pt"]
    assert "step-00000001/state.pt" not in st.list("step-00000001/")  # refused: nothing was stored
    assert not any(i.complete for i in checkpoint.scan(st))  # and no manifest was committed
    monkeypatch.undo()
    assert write_state(st, data).step == 1  # an undamaged save of the same step goes through


def test_gcs_upload_crc32c_is_the_one_computed_while_writing(gcp_emulator_url, monkeypatch):
    """No second read: the CRC32C that goes out is the writer's (the stored object has it)."""

    def no_second_read(*args, **kw):
        raise AssertionError("the file was read again to compute its CRC")

    monkeypatch.setattr(cloud, "file_crc", no_second_read)
    st = GCSStorage(gcp_emulator_url, GCSOptions(chunk_size=MiB, resumable_threshold=MiB))
    data = os.urandom(MiB + 3)
    write_state(st, data)

    assert st.bucket.get_blob("run/step-00000001/state.pt").crc32c == crc_b64(int(google_crc32c.value(data)))


def test_s3_on_moto_stores_a_damaged_file_and_the_writers_crc32_catches_it(s3_url, tmp_path):
    """A copy from the local tier carries the writer's CRC32: moto stores a file damaged since (it never
    checks), and the download is refused against the CRC32 the writer kept."""
    st = open_storage(s3_url)
    local = open_storage(str(tmp_path / "local"))
    crcs: dict[str, int] = {}
    manifest = layout.write(
        local,
        1,
        {"state.pt": lambda f: f.write(os.urandom(MiB))},
        reason="periodic",
        upload_crc=st.upload_crc,
        crcs=crcs,
    )
    flip = tmp_path / "local" / "step-00000001" / "state.pt"
    raw = bytearray(flip.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    flip.write_bytes(bytes(raw))
    layout.copy(local, st, checkpoint.CheckpointInfo(1, "step-00000001", "complete", manifest), crcs=crcs)
    (info,) = checkpoint.scan(st)
    with pytest.raises(CheckpointCorruptError, match="CRC32 of the downloaded object is .*, S3 holds"):
        checkpoint.verify(st, info)


@pytest.mark.parametrize("size", [MiB // 2, 40 * MiB + 5], ids=["one-put", "multipart"])
def test_s3_refuses_to_stream_a_file_damaged_on_the_local_disk_after_it_was_written(s3_url, monkeypatch, size):
    """Straight to S3 the upload reads the spool file as it lands; a byte changed on the disk after the writer
    computed its CRC32 fails the upload (nothing stored, no multipart upload left) instead of going up."""
    st = open_storage(s3_url)
    real = GrowingFile.finish

    def finish(self, size, crc=None):
        with open(self.path, "r+b") as f:  # in place: a byte of the last part, which the upload reads only now
            f.seek(size - 1000)
            byte = f.read(1)[0] ^ 0x08
            f.seek(size - 1000)
            f.write(bytes([byte]))
        real(self, size, crc)

    monkeypatch.setattr(GrowingFile, "finish", finish)
    data = os.urandom(size)
    with pytest.raises(StorageError, match="changed on the local disk after it was written"):
        write_state(st, data)
    assert not st.list("step-00000001/")
    assert not st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads")


def test_an_upload_from_the_local_tier_sends_the_crc32c_kept_when_it_was_written(gcp_emulator_url, tmp_path):
    """Periodic saves go to a local tier first and are copied up later: the copy carries the CRC32C
    computed while the local file was written, so a local file damaged since is refused."""
    local = open_storage(str(tmp_path / "local"))
    st = GCSStorage(gcp_emulator_url, GCSOptions(retry=RetryOptions(attempts=2)))
    crcs: dict[str, int] = {}
    data = os.urandom(MiB)
    manifest = layout.write(
        local, 1, {"state.pt": lambda f: f.write(data)}, reason="periodic", upload_crc=st.upload_crc, crcs=crcs
    )
    assert crcs == {"state.pt": int(google_crc32c.value(data))}
    flip = tmp_path / "local" / "step-00000001" / "state.pt"
    raw = bytearray(flip.read_bytes())
    raw[7] ^= 0x10
    flip.write_bytes(bytes(raw))
    info = checkpoint.CheckpointInfo(1, "step-00000001", "complete", manifest)
    with pytest.raises(StorageError, match="(?i)crc32c"):
        layout.copy(local, st, info, crcs=crcs)
    assert not any(i.complete for i in checkpoint.scan(st))


def test_periodic_saves_through_a_local_tier_never_read_a_file_again_for_its_crc(
    gcp_emulator_url, tmp_path, monkeypatch
):
    one_periodic_save_through_a_local_tier(gcp_emulator_url, tmp_path, monkeypatch)


def one_periodic_save_through_a_local_tier(url: str, tmp_path, monkeypatch) -> None:
    """A Guard's periodic save of step 1 to ``url`` through a local tier, with the file never read again
    for its upload checksum (``cloud.file_crc`` raises): the writer's pass must have kept it."""

    def no_second_read(*args, **kw):
        raise AssertionError("the file was read again to compute its upload checksum")

    monkeypatch.setattr(cloud, "file_crc", no_second_read)
    guard = spotguard.Guard(url, local_dir=str(tmp_path / "local"), every_steps=1, providers=[])
    guard.track(model=torch.nn.Linear(8, 8))
    with guard:
        guard.step(1)
        guard.wait()
    (info,) = checkpoint.scan(open_storage(url))
    assert info.complete and info.step == 1


# -- Azure ----------------------------------------------------------------------------------------
def azure(url: str, kind: str, **kw) -> AzureStorage:
    """Blocks of 1 MiB; ``kind`` "auto" is CRC64 here (awscrt is installed with the dev extras)."""
    fast = RetryOptions(attempts=2, initial=0.01, maximum=0.05)
    opts = dict(block_size=MiB, single_put_threshold=MiB, concurrency=3, request_attempts=2, retry=fast, **kw)
    return AzureStorage(url, AzureOptions(**opts) if kind == "auto" else AzureOptions(block_checksum=kind, **opts))


def record_requests(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every request the Azure SDK puts on the wire (its transport's ``send``)."""
    from azure.core.pipeline.transport import RequestsTransport

    sent: list = []
    real = RequestsTransport.send

    def send(self, request, **kw):
        sent.append(request)
        return real(self, request, **kw)

    monkeypatch.setattr(RequestsTransport, "send", send)
    return sent


def crc64(data: bytes) -> str:
    from awscrt.checksums import crc64nvme  # Azure's CRC64 is the CRC-64/NVME polynomial

    return base64.b64encode(crc64nvme(data).to_bytes(8, "little")).decode()


def md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


@pytest.mark.parametrize("kind", ["auto", "md5"], ids=["crc64", "md5"])
@pytest.mark.parametrize("size", [MiB // 2, 3 * MiB + 5], ids=["put-blob", "blocks"])
def test_azure_refuses_a_file_damaged_after_its_block_digests_were_computed(az_url, monkeypatch, kind, size):
    st = azure(az_url, kind)
    data = os.urandom(size)
    damaged = damage_before_upload(st, monkeypatch)
    with pytest.raises(StorageError, match="Azure refused its bytes \\((Crc64|Md5)Mismatch\\).*damaged or changed"):
        write_state(st, data)
    assert damaged == ["step-00000001/state.pt"]
    assert "step-00000001/state.pt" not in st.list("step-00000001/")  # refused: nothing was stored
    assert not any(i.complete for i in checkpoint.scan(st))  # and no manifest was committed
    monkeypatch.undo()  # (the storage keeps the connection string it was made with)
    assert write_state(st, data).step == 1  # an undamaged save of the same step goes through


@pytest.mark.parametrize("kind", ["auto", "md5"], ids=["crc64", "md5"])
def test_azure_blocks_carry_the_digests_of_the_bytes_as_written(az_url, monkeypatch, kind):
    """A clean multi-block save commits and verifies; every Put Block carried the digest of its
    block as the writer saw it, and nothing recomputed it from the file (no second read)."""

    def no_second_read(*args, **kw):
        raise AssertionError("the file was read again to compute its checksums")

    monkeypatch.setattr(cloud, "file_crc", no_second_read)
    st = azure(az_url, kind)
    sent = record_requests(monkeypatch)
    data = os.urandom(3 * MiB + 5)
    write_state(st, data)

    blocks = [r for r in sent if "comp=block&" in r.url or r.url.endswith("comp=block")]
    assert len(blocks) == 4
    want = [data[i : i + MiB] for i in range(0, len(data), MiB)]
    header, digest = ("x-ms-content-crc64", crc64) if kind == "auto" else ("Content-MD5", md5)
    assert sorted(r.headers[header] for r in blocks) == sorted(digest(b) for b in want)
    if kind == "auto":
        assert not any("Content-MD5" in r.headers for r in blocks)  # no MD5 of the SDK's own
    monkeypatch.undo()  # downloads check the CRC32 with file_crc
    (info,) = checkpoint.scan(st)
    checkpoint.verify(st, info)  # downloads it: the CRC32 in the metadata and the manifest's checksum agree
    with st.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == data


def test_azure_crc64_is_computed_once_while_the_file_is_written(az_url, monkeypatch):
    """The CRC64 function sees each byte once (a second pass over the file would double the count)."""
    seen = [0]
    real = azure_blocks._crc64

    def counting(data, crc):
        seen[0] += len(memoryview(data).cast("B"))
        return real(data, crc)

    monkeypatch.setattr(azure_blocks, "_crc64", counting)
    st = azure(az_url, "crc64")
    data = os.urandom(2 * MiB + 77)
    write_state(st, data)
    assert seen[0] == len(data)


def test_block_digests_do_not_depend_on_how_the_writes_were_cut():
    data = os.urandom(3 * 4096 + 17)
    for kind, digest in (("md5", md5), ("crc64", crc64)):
        update = azure_blocks.BlockChecksum(4096, kind)
        state, at = 0, 0
        for n in (1, 4095, 4097, 5000, 100_000):
            state = update(data[at : at + n], state)
            at += n
        assert [base64.b64encode(d).decode() for d in state.blocks()] == [
            digest(data[i : i + 4096]) for i in range(0, len(data), 4096)
        ]
        assert state.crc32 == zlib.crc32(data) and state.size == len(data)
        assert update(b"", 0).blocks() == [base64.b64decode(digest(b""))]  # an empty file: one empty block


def test_azure_refuses_to_upload_a_file_whose_size_changed_since_it_was_written(az_url, tmp_path):
    st = azure(az_url, "auto")
    path = tmp_path / "state.pt"
    path.write_bytes(os.urandom(MiB + 1))
    sums = st.upload_crc(path.read_bytes()[:MiB], 0)  # what the writer saw: one byte less
    with pytest.raises(StorageError, match="has 1048577 bytes, but 1048576 were written"):
        st.put_file("step-00000001/state.pt", path, crc=sums)
    assert st.list() == []


def test_periodic_saves_through_a_local_tier_to_azure_never_read_a_file_again(az_url, tmp_path, monkeypatch):
    sent = record_requests(monkeypatch)
    one_periodic_save_through_a_local_tier(az_url, tmp_path, monkeypatch)
    state = next(r for r in sent if r.method == "PUT" and r.url.split("?")[0].endswith("/state.pt"))
    assert "x-ms-content-crc64" in state.headers  # the writer's CRC64, kept in the local tier's pass


def test_without_awscrt_azure_blocks_carry_an_md5(az_url, monkeypatch):
    from spotguard.errors import MissingDependencyError

    monkeypatch.setattr(azure_blocks, "_crc64", None)
    assert azure(az_url, "auto").upload_crc.kind == "md5"
    with pytest.raises(MissingDependencyError, match=r"pip install 'spotguard\[azure\]'"):
        azure(az_url, "crc64")
