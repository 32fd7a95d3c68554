"""Chunked checksums: streamed and parallel digests agree for every algorithm; old manifests still
load; a flipped byte is caught before anything loads, whatever the algorithm."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.format import digest
from spotguard.checkpoint.format.digest import ALGORITHMS, ChunkedDigest, chunked_file_digest, read_file_digest
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError, ConfigError
from spotguard.storage import open_storage
from tests.helpers import chunked_digest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("alg", ALGORITHMS)
@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=5000), chunk=st.integers(1, 700), cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_streamed_and_parallel_digests_equal_the_definition(tmp_path_factory, alg, data, chunk, cuts):
    h = ChunkedDigest(alg, chunk)
    start = 0
    for cut in sorted(c for c in cuts if c <= len(data)) + [len(data)]:
        h.update(data[start:cut])
        start = cut
    path = tmp_path_factory.mktemp("d") / "f"
    path.write_bytes(data)
    want = chunked_digest(data, chunk, alg)
    assert h.hexdigest() == want
    assert chunked_file_digest(path, chunk, threads=3, alg=alg) == want
    assert read_file_digest(path, chunk, threads=3, alg=alg) == want  # the reads of a file still written


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_every_chunk_is_checked(tmp_path, alg):
    data = bytearray(os.urandom(10 * 4096 + 17))
    path = tmp_path / "f"
    good = chunked_digest(bytes(data), 4096, alg)
    for pos in (0, 4095, 4096, 5 * 4096 + 3, len(data) - 1):  # first, chunk edges, middle, last (short) chunk
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        assert chunked_file_digest(path, 4096, alg=alg) != good, pos


def guard_with_model(root, value: float):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(value)
    return spotguard.Guard(str(root), providers=[]).track(model=model), model


def flip(path: Path, pos: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if pos is None else pos] ^= 0x01
    path.write_bytes(bytes(raw))


def fixture_guard(root: Path) -> tuple[spotguard.Guard, torch.nn.Linear]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.zero_()
    return spotguard.Guard(str(root), providers=[]).track(model=model), model


@pytest.mark.parametrize("fmt", ["spotguard/1", "spotguard/2"])
def test_checkpoints_written_in_old_formats_still_load_and_a_flip_is_still_caught(tmp_path, fmt, caplog):
    """The fixtures were written by spotguard before format 3 (tests/checkpoint/format/fixtures/README.md)."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / fmt.replace("/", "-"), root)
    (info,) = checkpoint.scan(open_storage(str(root)))
    assert info.complete and info.manifest.format == fmt and info.manifest.files[0].alg == "sha256"
    guard, model = fixture_guard(root)
    assert guard.resume() == 7 and guard.extra["note"] == "written by spotguard before format 3"
    assert torch.equal(model.weight, torch.arange(12.0).reshape(3, 4)) and torch.all(model.bias == 0.5)
    flip(root / "step-00000007" / "state.pt")
    guard, model = fixture_guard(root)
    with caplog.at_level(logging.WARNING, logger="spotguard"), pytest.raises(spotguard.NoLoadableCheckpointError):
        guard.resume()
    assert "SHA-256 checksum does not match" in caplog.text and torch.all(model.weight == 0)


def test_an_old_manifest_copied_elsewhere_keeps_its_format(tmp_path):
    """Copying (``spotguard cp``, the upload of a local tier) rewrites the manifest: it stays the old format."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "spotguard-1", src)
    (info,) = checkpoint.scan(open_storage(str(src)))
    checkpoint.copy(open_storage(str(src)), open_storage(str(tmp_path / "dst")), info, verify=True)
    want = json.loads((src / "step-00000007" / "manifest.json").read_text())
    assert json.loads((tmp_path / "dst" / "step-00000007" / "manifest.json").read_text()) == want


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_new_manifests_name_their_algorithm_and_a_flip_fails_verification(tmp_path, monkeypatch, alg):
    monkeypatch.setenv(digest.ENV, alg)
    guard, _ = guard_with_model(tmp_path, 1.0)
    guard.save(1)
    raw = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    state = tmp_path / "step-00000001" / "state.pt"
    assert raw["format"] == "spotguard/3"
    assert raw["files"][0]["digest"] == {
        "alg": alg,
        "chunk": 16 << 20,
        "value": chunked_digest(state.read_bytes(), alg=alg),
    }
    info = checkpoint.latest(open_storage(str(tmp_path)))
    checkpoint.verify(open_storage(str(tmp_path)), info)
    for pos in (0, state.stat().st_size - 1):
        flip(state, pos)
        with pytest.raises(CheckpointCorruptError, match="checksum does not match the manifest"):
            checkpoint.verify(open_storage(str(tmp_path)), info)
        flip(state, pos)


def test_blake3_is_the_default_and_sha256_the_fallback_without_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv(digest.ENV, raising=False)
    assert digest.default_alg() == "blake3"
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    assert digest.default_alg() == "sha256"
    guard, _ = guard_with_model(tmp_path, 1.0)
    assert guard.save(1).files[0].alg == "sha256"


def test_a_checkpoint_whose_algorithm_is_not_installed_says_what_to_install(tmp_path, monkeypatch):
    guard, _ = guard_with_model(tmp_path, 1.0)
    guard.save(1)
    monkeypatch.setitem(sys.modules, "blake3", None)
    info = checkpoint.latest(open_storage(str(tmp_path)))
    with pytest.raises(CheckpointFormatError, match="pip install blake3"):
        checkpoint.verify(open_storage(str(tmp_path)), info)


def test_an_unknown_checksum_setting_is_a_config_error(monkeypatch):
    monkeypatch.setenv(digest.ENV, "md5")
    with pytest.raises(ConfigError, match="SPOTGUARD_CHECKSUM"):
        digest.default_alg()


@pytest.mark.parametrize(
    "bad",
    [
        {"alg": "md5", "chunk": 16, "value": "0" * 32},
        {"alg": "blake3", "chunk": 16, "value": "0" * 32},  # a BLAKE3 digest has 64 hex digits
        {"alg": "xxh3-128", "chunk": 0, "value": "0" * 32},  # format 3 is always chunked
        {"alg": "blake3", "chunk": True, "value": "0" * 64},
        "blake3:00",
    ],
)
def test_a_bad_digest_entry_is_a_corrupt_manifest(bad):
    raw = {"format": "spotguard/3", "step": 1, "reason": "manual", "time": "t"}
    raw["files"] = [{"name": "state.pt", "size": 1, "digest": bad}]
    with pytest.raises(CheckpointCorruptError, match="invalid manifest"):
        Manifest.from_bytes(json.dumps(raw).encode())


def test_an_unknown_manifest_format_is_corrupt(tmp_path):
    """Not a spotguard/N format (a newer spotguard's is ``newer-format``: tests/checkpoint/format/test_format.py)."""
    guard, _ = guard_with_model(tmp_path, 1.0)
    guard.save(1)
    path = tmp_path / "step-00000001" / "manifest.json"
    path.write_text(path.read_text().replace("spotguard/3", "spotguard/2.5"))
    (info,) = checkpoint.scan(open_storage(str(tmp_path)))
    assert info.status == "corrupt" and "not a spotguard/1 or spotguard/2 or spotguard/3 manifest" in info.problem
