"""Uploads carry the CRC the writer kept while the bytes passed: a file damaged on the local disk
between its write and its upload is refused by a service that checks, and the save fails cleanly.

What each local server enforces (checked here):
- gcp-storage-emulator: refuses an upload whose bytes do not match the CRC32C it was sent, for
  multipart and resumable uploads alike (as GCS does).
- moto (S3): stores the CRC32 it is sent but never refuses a wrong one, so the damaged file is
  stored; the download's check against the CRC32 S3 holds (the writer's) catches it before
  anything loads it (so would the manifest's checksum).
- Azurite checks the Content-MD5 of each block, but the Azure SDK computes those from the bytes it
  reads for the upload, after the damage: not covered by this test (see docs/storage.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import google_crc32c
import pytest
import torch

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint import layout
from spotguard.errors import CheckpointCorruptError, StorageError
from spotguard.storage import cloud, open_storage
from spotguard.storage._common import crc_b64
from spotguard.storage.base import Storage
from spotguard.storage.gcs import GCSOptions, GCSStorage
from spotguard.storage.retry import RetryOptions

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)


def damage_before_upload(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Flip one byte of every file just before it is uploaded (after its checksums were computed)."""
    real = storage.put_file
    damaged: list[str] = []

    def put_file(key: str, path: Path, **kw) -> None:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        path.write_bytes(bytes(raw))
        damaged.append(key)
        real(key, path, **kw)

    monkeypatch.setattr(storage, "put_file", put_file)
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


def test_s3_on_moto_stores_a_damaged_file_and_the_writers_crc32_catches_it(s3_url, monkeypatch):
    st = open_storage(s3_url)
    damaged = damage_before_upload(st, monkeypatch)
    write_state(st, os.urandom(MiB))  # moto never checks the CRC32 it is sent: the upload is accepted
    assert damaged == ["step-00000001/state.pt"]
    (info,) = checkpoint.scan(st)
    with pytest.raises(CheckpointCorruptError, match="CRC32 of the downloaded object is .*, S3 holds"):
        checkpoint.verify(st, info)


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
    def no_second_read(*args, **kw):
        raise AssertionError("the file was read again to compute its CRC")

    monkeypatch.setattr(cloud, "file_crc", no_second_read)
    model = torch.nn.Linear(8, 8)
    guard = spotguard.Guard(gcp_emulator_url, local_dir=str(tmp_path / "local"), every_steps=1, providers=[])
    guard.track(model=model)
    with guard:
        guard.step(1)
        guard.wait()
    (info,) = checkpoint.scan(open_storage(gcp_emulator_url))
    assert info.complete and info.step == 1
