"""A file's checksum checked on a thread of its own while the resume reads it: the reader waits behind
the check's walk, a mismatch is still the error a resume reports, and nothing tracked is touched
before the checksum matched (with the GPU upload path running, the CPU standing in for the device)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.checkpoint.format import digest
from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.checkpoint.format.verifying import ALG_NAMES, Verifying
from spotguard.checkpoint.state import upload
from spotguard.errors import CheckpointCorruptError
from tests.helpers import chunked_digest

CHUNK = 1 << 20


@pytest.fixture
def blob(tmp_path) -> tuple[Path, FileEntry]:
    data = os.urandom(8 * CHUNK + 123)
    path = tmp_path / "blob"
    path.write_bytes(data)
    return path, FileEntry("blob", len(data), chunked_digest(data, CHUNK, digest.SHA256), CHUNK, digest.SHA256)


@pytest.fixture
def gate(monkeypatch):
    """The walk stops before reading chunk 3 until ``gate.set()``; ``gate.calls`` counts chunks read in."""
    opened = threading.Event()
    opened.calls = 0  # type: ignore[attr-defined]
    real = digest._read_in

    def read_in(mm, start, length):
        if start >= 3 * CHUNK:
            assert opened.wait(30)
        opened.calls += 1  # type: ignore[attr-defined]
        return real(mm, start, length)

    monkeypatch.setattr(digest, "_read_in", read_in)
    return opened


def test_a_reader_waits_behind_the_walk_and_the_check_passes(blob, gate):
    path, entry = blob
    check = Verifying(path, entry, "step-1/blob")
    try:
        check.wait_read(2 * CHUNK)  # read in before the gate: returns at once
        assert 2 * CHUNK <= check.read <= 3 * CHUNK
        waiter = threading.Thread(target=check.wait_read, args=(6 * CHUNK,))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # chunk 6 is not read in yet: the reader waits
        gate.set()
        waiter.join(30)
        assert not waiter.is_alive() and check.read >= 6 * CHUNK
        check.result()
        assert check.read == entry.size
    finally:
        gate.set()
        check.close()


def test_a_mismatch_is_the_error_and_close_stops_a_walk_within_a_chunk(blob, gate):
    path, entry = blob
    check = Verifying(path, dataclasses.replace(entry, checksum="0" * 64), "x/f")
    gate.set()
    with pytest.raises(CheckpointCorruptError, match="x/f: SHA-256 checksum does not match the manifest"):
        check.result()
    check.close()  # after the end: nothing to stop

    gate.clear()
    gate.calls = 0
    check = Verifying(path, entry, "x/f")
    check.wait_read(3 * CHUNK)  # the walk is held at chunk 3, the reads ahead of it queued
    closer = threading.Thread(target=check.close)
    closer.start()
    closer.join(0.3)
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert gate.calls <= 3 + digest.READERS  # the reads in flight, not the file's 9 chunks
    with pytest.raises(Exception):  # noqa: B017, PT011 - a check stopped before its end never passes
        check.result()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))  # ~16 MB, ~48 MB saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    return model, opt


def _as_device(monkeypatch) -> None:
    """The resume's upload path with the CPU as the device (tests/checkpoint/state/test_upload.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(upload, "_cuda", lambda d: d.type == "cpu")
    monkeypatch.setattr(upload, "_fits", lambda todo: True)


def test_the_upload_reads_behind_the_walk_not_after_it(tmp_path, monkeypatch):
    """The first tensor bytes are copied while the check has not yet read the file's end: one pass
    over a cold file, not a whole verify and then a whole load."""
    model, opt = _model()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.save(5)
    g.close()

    _as_device(monkeypatch)
    first_copy, end_read = threading.Event(), threading.Event()
    real_pread, real_read_in = upload._pread_into, digest._read_in
    end_read_at_first_copy: list[bool] = []

    def pread(fd, address, n, offset):
        if not first_copy.is_set():
            end_read_at_first_copy.append(end_read.is_set())
            first_copy.set()
        real_pread(fd, address, n, offset)

    def read_in(mm, start, length):
        last = start + length >= len(mm)
        if last:  # the file's last chunk waits (up to 10 s) for a first copy
            first_copy.wait(10)
        done = real_read_in(mm, start, length)
        if last:
            end_read.set()
        return done

    monkeypatch.setattr(upload, "_pread_into", pread)
    monkeypatch.setattr(digest, "_read_in", read_in)
    fresh, fresh_opt = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    g2 = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g2.track(model=fresh, optimizer=fresh_opt)
    assert g2.resume() == 5
    g2.close()
    assert end_read_at_first_copy == [False]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["pickle", "tensor bytes"])
def test_a_flipped_byte_read_ahead_of_the_check_loads_nothing_and_the_older_checkpoint_is_used(
    tmp_path, monkeypatch, caplog, where
):
    model, opt = _model()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.save(5)
    older = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    g.save(6)
    g.close()
    state_file = tmp_path / "ck" / "step-00000006" / "state.pt"
    data = bytearray(state_file.read_bytes())
    if where == "pickle":
        at = data.index(b"data.pkl") + 200  # inside the pickle, the first member of torch's zip
    else:
        at = len(data) - 4096  # inside the last tensor's bytes
    data[at] ^= 0xFF
    state_file.write_bytes(bytes(data))

    _as_device(monkeypatch)
    fresh, fresh_opt = _model()
    g2 = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g2.track(model=fresh, optimizer=fresh_opt)
    assert g2.resume() == 5
    g2.close()
    assert (
        f"step-00000006/state.pt: {ALG_NAMES[digest.default_alg()]} checksum does not match the manifest" in caplog.text
    )
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, older[k]), k


def test_the_zip_index_is_read_before_the_walk_fills_the_disk_queue(tmp_path, monkeypatch):
    """torch.load reads scattered pages (the pickle, each record's header): behind a walk with reads in
    flight each waited its turn, so the load, and the upload after it, started only as the walk ended."""
    model, opt = _model()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.save(5)
    g.close()

    order: list[str] = []
    real_load, real_start = torch.load, Verifying.start
    monkeypatch.setattr(torch, "load", lambda *a, **k: order.append("load") or real_load(*a, **k))
    monkeypatch.setattr(Verifying, "start", lambda self: order.append("walk") or real_start(self))
    fresh, fresh_opt = _model()
    g2 = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g2.track(model=fresh, optimizer=fresh_opt)
    assert g2.resume() == 5
    g2.close()
    assert order[:2] == ["load", "walk"]


def test_the_walk_reads_without_holding_the_gil(tmp_path, monkeypatch):
    """The kernel's read of each chunk goes through a call that lets other threads run (mmap.madvise
    holds the GIL: a cold walk starved the resume's load and upload)."""
    data = os.urandom(4 * CHUNK)
    path = tmp_path / "f"
    path.write_bytes(data)
    calls: list[int] = []
    libc = digest._libc()

    class Counting:
        def madvise(self, address, n, advice):
            calls.append(n)
            return libc.madvise(address, n, advice)

    monkeypatch.setattr(digest, "_libc", lambda: Counting())
    assert digest.chunked_file_digest(path, CHUNK, alg=digest.SHA256) == chunked_digest(data, CHUNK, digest.SHA256)
    assert sum(calls) == len(data) and not isinstance(libc, ctypes.PyDLL)  # a CDLL call releases the GIL


def test_an_interrupt_while_reading_a_corrupt_file_is_not_taken_for_its_corruption(tmp_path, monkeypatch):
    """Ctrl-C during the read ends the resume; it does not become "corrupt, try the older one"."""
    from spotguard.checkpoint import single

    model, opt = _model()
    g = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g.track(model=model, optimizer=opt)
    g.save(5)
    g.save(6)
    g.close()
    state_file = tmp_path / "ck" / "step-00000006" / "state.pt"
    data = bytearray(state_file.read_bytes())
    data[-4096] ^= 0xFF
    state_file.write_bytes(bytes(data))
    seen: list[str] = []

    def interrupted(self, path, info, tracked, check):
        seen.append(info.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(single.SingleEngine, "_read", interrupted)
    fresh, fresh_opt = _model()
    g2 = spotguard.Guard(str(tmp_path / "ck"), providers=[], save_on_exit=False)
    g2.track(model=fresh, optimizer=fresh_opt)
    with pytest.raises(KeyboardInterrupt):
        g2.resume()
    g2.close()
    assert seen == ["step-00000006"]  # the older checkpoint was not tried
