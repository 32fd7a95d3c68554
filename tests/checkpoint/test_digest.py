"""Chunked checksums: streamed and parallel digests agree; old whole-file manifests still load; flips are caught."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.digest import ChunkedSha256, chunked_file_digest
from spotguard.errors import CheckpointCorruptError
from spotguard.storage import open_storage
from tests.helpers import chunked_sha256


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), chunk=st.integers(1, 700), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_streamed_and_parallel_digests_equal_the_definition(tmp_path_factory, data, chunk, cuts):
    h = ChunkedSha256(chunk)
    start = 0
    for cut in sorted(c for c in cuts if c <= len(data)) + [len(data)]:
        h.update(data[start:cut])
        start = cut
    path = tmp_path_factory.mktemp("d") / "f"
    path.write_bytes(data)
    want = chunked_sha256(data, chunk)
    assert h.hexdigest() == want
    assert chunked_file_digest(path, chunk, threads=3) == want


def test_every_chunk_is_checked(tmp_path):
    data = bytearray(os.urandom(10 * 4096 + 17))
    path = tmp_path / "f"
    good = chunked_sha256(bytes(data), 4096)
    for pos in (0, 4095, 4096, 5 * 4096 + 3, len(data) - 1):  # first, chunk edges, middle, last (short) chunk
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        assert chunked_file_digest(path, 4096) != good, pos


def guard_with_model(root, value: float):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(value)
    return spotguard.Guard(str(root), providers=[]).track(model=model), model


def as_spotguard_1(step_dir) -> None:
    """Rewrite a checkpoint's manifest as spotguard 0.1 wrote it: format 1, whole-file SHA-256, no chunk_size."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["format"] = "spotguard/1"
    for f in manifest["files"]:
        del f["chunk_size"]
        f["sha256"] = hashlib.sha256((step_dir / f["name"]).read_bytes()).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_checkpoints_with_whole_file_sha256_still_load_and_flips_are_still_caught(tmp_path, caplog):
    guard, _ = guard_with_model(tmp_path, 1.0)
    guard.save(1)
    guard2, _ = guard_with_model(tmp_path, 2.0)
    guard2.save(2)
    for step in (1, 2):
        as_spotguard_1(tmp_path / checkpoint.step_dir(step))
    fresh, model = guard_with_model(tmp_path, 0.0)
    assert fresh.resume() == 2 and torch.all(model.weight == 2.0)
    state = tmp_path / "step-00000002" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))
    fresh, model = guard_with_model(tmp_path, 0.0)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert fresh.resume() == 1 and torch.all(model.weight == 1.0)
    assert "SHA-256 does not match" in caplog.text
    info = checkpoint.scan(open_storage(str(tmp_path)))[0]
    assert info.manifest.format == "spotguard/1" and info.manifest.files[0].chunk_size == 0


def test_new_manifests_are_chunked_and_a_flip_fails_verification(tmp_path):
    guard, _ = guard_with_model(tmp_path, 1.0)
    manifest = guard.save(1)
    assert manifest.format == "spotguard/2" and manifest.files[0].chunk_size == 16 << 20
    info = checkpoint.latest(open_storage(str(tmp_path)))
    checkpoint.verify(open_storage(str(tmp_path)), info)
    state = tmp_path / "step-00000001" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[-1] ^= 0x80
    state.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="SHA-256 does not match"):
        checkpoint.verify(open_storage(str(tmp_path)), info)


def test_an_unknown_manifest_format_is_corrupt(tmp_path):
    """Not a spotguard/N format (a newer spotguard's is ``newer-format``: tests/checkpoint/test_format.py)."""
    guard, _ = guard_with_model(tmp_path, 1.0)
    guard.save(1)
    path = tmp_path / "step-00000001" / "manifest.json"
    path.write_text(path.read_text().replace("spotguard/2", "spotguard/2.5"))
    (info,) = checkpoint.scan(open_storage(str(tmp_path)))
    assert info.status == "corrupt" and "not a spotguard/1 or spotguard/2 manifest" in info.problem
