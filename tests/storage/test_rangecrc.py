"""``RangeCrcFile``: the CRC32 of a file written range by range, in any interleaving, without reading it
back; and S3's and Azure's downloads through it (moto, Azurite): checked as they land, not read again."""

from __future__ import annotations

import io
import os
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.storage import cloud, rangecrc
from spotguard.storage.azure import AzureOptions, AzureStorage
from spotguard.storage.rangecrc import RangeCrcFile
from spotguard.storage.s3 import S3Options, S3Storage

MiB = 1 << 20


def _write(f: RangeCrcFile, at: int, data: bytes) -> None:
    f.seek(at)
    f.write(data)


def _interleaved(
    data: bytes, cuts: list[int], piece: int, rng: random.Random, retries: bool = False
) -> list[tuple[int, bytes]]:
    """The writes of ranges ``cuts`` (each in order, ``piece`` bytes at a time), interleaved at random;
    with ``retries``, some ranges first write part of themselves as garbage, then start over (boto3's
    retry of a range cut mid-way)."""
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    queues = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        writes = [(at, data[at : min(at + piece, end)]) for at in range(start, end, piece)]
        if retries and len(writes) > 1 and rng.random() < 0.5:
            cut = rng.randrange(1, len(writes))
            writes = [(at, bytes(len(chunk))) for at, chunk in writes[:cut]] + writes
        queues.append(writes)
    out = []
    while any(queues):
        q = rng.choice([q for q in queues if q])
        out.append(q.pop(0))
    return out


@settings(max_examples=80, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=4096),
    cuts=st.lists(st.integers(min_value=0, max_value=4096), max_size=6),
    piece=st.integers(min_value=1, max_value=700),
    seed=st.integers(min_value=0, max_value=1000),
    retries=st.booleans(),
)
def test_any_interleaving_of_in_order_ranges_gives_the_files_crc32(data, cuts, piece, seed, retries):
    raw = io.BytesIO()
    f = RangeCrcFile(raw)
    for at, chunk in _interleaved(data, cuts, piece, random.Random(seed), retries):
        _write(f, at, chunk)
    assert raw.getvalue() == data
    assert f.crc(len(data)) == zlib.crc32(data)


def test_a_range_read_again_from_its_start_replaces_its_run():
    data = os.urandom(3000)
    f = RangeCrcFile(io.BytesIO())
    _write(f, 0, data[:1000])
    _write(f, 1000, b"\0" * 400)  # the second range's first try, cut short
    _write(f, 2000, data[2000:])
    _write(f, 1000, data[1000:2000])  # its retry, from its start
    assert f.crc(3000) == zlib.crc32(data)


def test_what_no_run_explains_gives_no_crc(monkeypatch):
    data = os.urandom(3000)
    inside = RangeCrcFile(io.BytesIO())
    _write(inside, 0, data[:2000])
    _write(inside, 500, data[500:1000])  # inside a run: not a retry of a range's start
    _write(inside, 2000, data[2000:])
    assert inside.crc(3000) is None
    across = RangeCrcFile(raw := io.BytesIO())  # a write over another run's start (a server past its range)
    _write(across, 2, b"CC")
    _write(across, 0, b"AAX")
    _write(across, 0, b"AA")
    assert raw.getvalue() == b"AAXC" and across.crc(4) is None
    gap = RangeCrcFile(io.BytesIO())
    _write(gap, 0, data[:1000])
    _write(gap, 2000, data[2000:])
    assert gap.crc(3000) is None
    whole = RangeCrcFile(io.BytesIO())
    _write(whole, 0, data)
    assert whole.crc(2999) is None and whole.crc(3000) == zlib.crc32(data)
    two = RangeCrcFile(io.BytesIO())
    _write(two, 1000, data[1000:])
    _write(two, 0, data[:1000])
    monkeypatch.setattr(rangecrc, "_combine", lambda: None)  # no awscrt, or one without combine_crc32
    assert two.crc(3000) is None


@pytest.fixture
def file_passes(monkeypatch) -> list[str]:
    """The names of the files ``_verify`` read again for their checksum."""
    seen: list[str] = []
    real = cloud.file_crc
    monkeypatch.setattr(cloud, "file_crc", lambda path, *a: seen.append(path.name) or real(path, *a))
    return seen


@pytest.mark.parametrize("backend", ["s3", "azure"])
def test_a_download_in_ranges_is_checked_as_it_lands(backend, request, file_passes):
    """moto (a multipart object with a FULL_OBJECT CRC32) and Azurite (the CRC32 in the blob's
    metadata), each read back as concurrent ranged GETs: checked without reading the file again."""
    if backend == "s3":
        options = S3Options(part_size=5 * MiB, multipart_threshold=5 * MiB, concurrency=3)
        store = S3Storage(request.getfixturevalue("s3_url"), options)
    else:
        store = AzureStorage(request.getfixturevalue("az_url"), AzureOptions(block_size=4 * MiB, concurrency=3))
    data = os.urandom(17 * MiB + 5)
    with store.open_write("step-00000001/state.pt") as f:
        f.write(data)
    with store.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == data
    assert file_passes == []
