"""Items of a DCP shard file read straight into their targets (checkpoint/sharded/item_io.py), else loaded as before."""

from __future__ import annotations

import io
import os
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spotguard.checkpoint.sharded import item_io
from spotguard.checkpoint.sharded.dcp import SpotguardReader, SpotguardWriter
from spotguard.storage import LocalStorage

STEP = "step-00000001"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved(tmp_path: Path, sd: dict[str, torch.Tensor]) -> SpotguardReader:
    dcp.save(sd, storage_writer=SpotguardWriter(LocalStorage(str(tmp_path)), STEP, 0), no_dist=True)

    @contextmanager
    def opener(name: str):
        yield tmp_path / STEP / name

    return SpotguardReader(opener)


@pytest.fixture
def cpu_loads(monkeypatch) -> list[object]:
    """The map_location of every torch.load that materialises tensors on the CPU."""
    seen: list[object] = []
    real = torch.load

    def spy(*args, **kwargs):
        if kwargs.get("map_location") != "meta":
            seen.append(kwargs.get("map_location"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return seen


def test_plain_tensors_are_read_into_their_targets_without_a_tensor_in_between(tmp_path, cpu_loads):
    g = torch.Generator().manual_seed(0)
    source = {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (101,), generator=g),
        "mask": torch.rand(7, 3, 2, generator=g) > 0.5,
    }
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    where = {k: v.data_ptr() for k, v in target.items()}
    with saved(tmp_path, source) as reader:
        dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in source.items():
        assert torch.equal(target[k], v), k
        assert target[k].data_ptr() == where[k], k  # filled in place
    assert cpu_loads == []  # no item went through a full torch.load


def test_other_items_are_loaded_the_ordinary_way_and_still_restore(tmp_path, cpu_loads):
    g = torch.Generator().manual_seed(1)
    source = {
        "scalar": torch.tensor(3.25),
        "strided": torch.randn(5, 4, generator=g),
        "float64": torch.randn(6, generator=g).double(),
    }
    target = {
        "scalar": torch.tensor(0.0),
        "strided": torch.zeros(4, 5).t(),  # a non-contiguous target
        "float64": torch.zeros(6, dtype=torch.float64),
    }
    with saved(tmp_path, source) as reader:
        dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    assert len(cpu_loads) == 2  # the scalar and the strided target; the float64 one is plain


def test_a_compressed_or_foreign_byte_order_record_is_not_read_raw(tmp_path):
    def as_slice(blob: bytes, prefix: bytes = b"junk" * 3) -> item_io.Slice:
        path = tmp_path / "blob"
        path.write_bytes(prefix + blob + b"tail")
        fd = os.open(path, os.O_RDONLY)
        return item_io.Slice(fd, len(prefix), len(blob))

    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(value, buf)
    meta = torch.load(io.BytesIO(buf.getvalue()), map_location="meta", weights_only=True)

    plain = as_slice(buf.getvalue())
    out = torch.zeros(3, 4)
    assert item_io.read_into(plain, meta, out) and torch.equal(out, value)  # at an offset in a larger file
    os.close(plain.fd)

    def rewritten(change) -> bytes:
        src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
        dst = io.BytesIO()
        with zipfile.ZipFile(dst, "w") as z:
            for info in src.infolist():
                name, data, kind = change(info.filename, src.read(info), zipfile.ZIP_STORED)
                z.writestr(name, data, compress_type=kind)
        return dst.getvalue()

    for change in (
        lambda n, d, k: (n, d, zipfile.ZIP_DEFLATED if n.endswith("data/0") else k),
        lambda n, d, k: (n, b"big" if n.endswith("byteorder") else d, k),
        lambda n, d, k: (n, d + b"\0" * 4 if n.endswith("data/0") else d, k),  # a record of another size
    ):
        part = as_slice(rewritten(change))
        out = torch.zeros(3, 4)
        assert not item_io.read_into(part, meta, out)
        assert not out.any()  # nothing written
        os.close(part.fd)


def _zip_version_needed(data: bytes, value: int) -> bytes:
    """``data`` with the "version needed to extract" of every central directory record set to ``value``."""
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        out[at + 6] = value
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


def test_a_record_zipfile_does_not_support_is_loaded_the_ordinary_way(tmp_path, cpu_loads):
    """A "version needed" of 0xFF: ``zipfile`` raises NotImplementedError, ``torch.load`` still loads it."""
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(value, buf)
    odd = _zip_version_needed(buf.getvalue(), 0xFF)
    assert torch.equal(torch.load(io.BytesIO(odd), weights_only=True), value)
    (tmp_path / "blob").write_bytes(odd)
    fd = os.open(tmp_path / "blob", os.O_RDONLY)
    try:
        out = torch.zeros(3, 4)
        meta = torch.load(io.BytesIO(odd), map_location="meta", weights_only=True)
        assert not item_io.read_into(item_io.Slice(fd, 0, len(odd)), meta, out) and not out.any()
    finally:
        os.close(fd)
    # Every item of a shard file so: the load restores them all, each through torch.load.
    source = {"a": torch.randn(8, 3), "b": torch.arange(5)}
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    with saved(tmp_path / "dcp", source) as reader:
        shards = list((tmp_path / "dcp" / STEP / "shards").glob("*.distcp"))
        for shard in shards:
            shard.write_bytes(_zip_version_needed(shard.read_bytes(), 0xFF))
        cpu_loads.clear()
        dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    assert shards and len(cpu_loads) == 2
