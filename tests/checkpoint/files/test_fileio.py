"""DirectFile: exact bytes, size and checksum whatever the chunking; torch.save into it; fallbacks."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.checkpoint.files import fileio
from spotguard.checkpoint.files.fileio import ALIGN, O_DIRECT, DirectFile
from spotguard.errors import SaveCancelled
from tests.helpers import chunked_digest

SMALL = 2 * ALIGN  # a small buffer so that a few KB cross many buffer boundaries


def write_chunks(path: Path, chunks: list[bytes], **kw) -> DirectFile:
    with DirectFile(path, **kw) as f:
        for c in chunks:
            assert f.write(c) == len(c)
    return f


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, SMALL, SMALL + 1, 5 * SMALL // 2])
def test_bytes_size_and_digest_are_exact_at_buffer_boundaries(tmp_path, size):
    data = os.urandom(size)
    f = write_chunks(tmp_path / "f", [data], buffer_size=SMALL)
    assert (tmp_path / "f").read_bytes() == data  # the O_DIRECT block padding is cut off
    assert f.size == size and f.hexdigest() == chunked_digest(data)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3 * SMALL), max_size=12))
def test_any_chunking_gives_the_same_file(tmp_path_factory, sizes):
    path = tmp_path_factory.mktemp("chunks") / "f"
    chunks = [os.urandom(n) for n in sizes]
    f = write_chunks(path, chunks, buffer_size=SMALL)
    assert path.read_bytes() == b"".join(chunks)
    assert f.hexdigest() == chunked_digest(b"".join(chunks))


def test_torch_save_into_it_loads_with_weights_only_and_mmap(tmp_path):
    state = {"w": torch.randn(300, 700), "step": 7, "nested": [torch.arange(10), {"b": torch.ones(3)}]}
    with DirectFile(tmp_path / "state.pt", buffer_size=SMALL) as f:
        torch.save(state, f)
    loaded = torch.load(tmp_path / "state.pt", weights_only=True, mmap=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert torch.equal(loaded["nested"][0], torch.arange(10)) and torch.equal(loaded["nested"][1]["b"], torch.ones(3))
    assert f.hexdigest() == chunked_digest((tmp_path / "state.pt").read_bytes())


needs_o_direct = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")


@needs_o_direct
def test_a_filesystem_that_refuses_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs did before Linux 6.6
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", refusing_open)
    data = os.urandom(3 * SMALL + 5)
    f = write_chunks(tmp_path / "f", [data], buffer_size=SMALL)
    assert not f.direct and (tmp_path / "f").read_bytes() == data


@needs_o_direct
def test_a_filesystem_that_refuses_o_direct_writes_switches_to_buffered_midway(tmp_path, monkeypatch):
    real_write = os.write

    def refusing_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as some FUSE mounts do
        return real_write(fd, data)

    monkeypatch.setattr(fileio.os, "write", refusing_write)
    data = os.urandom(3 * SMALL + 5)
    f = write_chunks(tmp_path / "f", [data], buffer_size=SMALL)
    assert not f.direct and (tmp_path / "f").read_bytes() == data


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_write_error_is_raised_not_swallowed():
    with pytest.raises(OSError) as e:
        write_chunks(Path("/dev/full"), [b"x" * (3 * SMALL)], buffer_size=SMALL)
    assert e.value.errno == errno.ENOSPC


def test_an_error_inside_the_block_propagates_and_closes(tmp_path):
    with pytest.raises(RuntimeError, match="serialiser failed"):
        with DirectFile(tmp_path / "f", buffer_size=SMALL) as f:
            f.write(b"y" * (SMALL + 10))
            raise RuntimeError("serialiser failed")
    assert f.closed


def test_buffer_size_must_be_aligned(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        DirectFile(tmp_path / "f", buffer_size=1000)


def test_a_cancel_stops_the_file_within_one_buffer_not_at_its_end(tmp_path, monkeypatch):
    """An abandoned periodic save gives the disk up for the emergency one at once, mid-file."""
    cancel = threading.Event()
    written: list[int] = []
    real = DirectFile._write_all

    def counting(self, view, *args):
        written.append(len(view))
        return real(self, view, *args)

    monkeypatch.setattr(DirectFile, "_write_all", counting)
    f = DirectFile(tmp_path / "f", buffer_size=SMALL, cancel=cancel)
    with pytest.raises(SaveCancelled):
        with f:
            f.write(os.urandom(SMALL))  # the first buffer is written
            cancel.set()
            for _ in range(100):  # a large file's worth of buffers, once cancelled
                f.write(os.urandom(SMALL))
    assert sum(written) <= 2 * SMALL  # at most the buffer already on its way
    assert f.closed


def test_the_work_of_a_file_leaves_out_the_producers_pauses(tmp_path):
    """A writer descheduled between its writes (a niced thread beside a busy loop) makes the file take
    longer, not cost more: ``work_seconds`` is its disk time, its hash's and its producer's CPU time."""
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    cpu0 = time.thread_time()
    with DirectFile(tmp_path / "f", buffer_size=1 << 20) as f:
        for _ in range(8):
            f.write(block)
            time.sleep(0.1)
    wall, produced = time.perf_counter() - t0, time.thread_time() - cpu0
    assert wall >= 0.8
    assert 0 < f.hash_s and 0 < f.io_s
    assert f.work_seconds(produced) == max(f.io_s - f.cpu_wait.seconds, f.hash_s, produced) < 0.4


def test_a_misspelt_bound_of_a_file_write_is_refused_before_anything_is_written(tmp_path):
    """``filewrite.write``/``put`` take their deadline, cancel event and meter as keywords of one family
    (``Bounds``): a typo there would otherwise drop the deadline silently."""
    from spotguard.checkpoint.files import filewrite
    from spotguard.storage import open_storage

    storage = open_storage(str(tmp_path / "store"))
    with pytest.raises(TypeError, match=r"\['deadlin'\]; bounds: \['cancel', 'deadline', 'meter'\]"):
        filewrite.put(storage, "step-1/a.pt", "a.pt", lambda f: f.write(b"x"), deadlin=5.0)  # type: ignore[call-arg]
    assert not list((tmp_path / "store").rglob("a.pt"))
    entry = filewrite.put(storage, "step-1/a.pt", "a.pt", lambda f: f.write(b"x"), deadline=None)
    assert entry.size == 1
