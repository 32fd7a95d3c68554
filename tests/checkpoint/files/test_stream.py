"""stream.save: torch.save's bytes exactly, the storages fed through a bounded ring."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from spotguard.checkpoint.files import serialize, stream
from spotguard.checkpoint.files.fileio import DirectFile


def awkward_state() -> dict:
    """Views, shared and transposed storages, odd dtypes, empty and 0-d tensors, plain values."""
    base = torch.randn(64, 33)
    return {
        "model": {"w": base, "view": base[3:9], "t": base.t(), "bias": torch.randn(33)},
        "ints": torch.arange(100_000, dtype=torch.int64),
        "half": torch.randn(17, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "nested": [torch.ones(5), (7, "name", {"x": torch.zeros(2, 2)})],
        "step": 12,
    }


def torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    serialize.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "ring",
    [
        None,  # host storages from their own memory
        stream.Ring(chunk=4096, slots=2, copy_host=True),  # every byte through the ring, many chunks per storage
        stream.Ring(chunk=1 << 20, slots=3, copy_host=True),  # whole storages per chunk
    ],
)
def test_the_file_is_byte_for_byte_what_torch_save_writes(ring):
    state = awkward_state()
    out = io.BytesIO()
    stream.save(state, out, ring)
    assert out.getvalue() == torch_bytes(state)
    if ring is not None:  # every storage's bytes went through the buffers, once
        assert ring.copied == sum(s.nbytes() for s in stream.storage_order(state) or [])


def test_it_loads_with_weights_only_and_mmap_after_an_odirect_write(tmp_path):
    state = awkward_state()
    with DirectFile(tmp_path / "state.pt") as f:
        stream.save(state, f, stream.Ring(chunk=8192, slots=2, copy_host=True))
    loaded = torch.load(tmp_path / "state.pt", weights_only=True, mmap=True)
    assert torch.equal(loaded["model"]["t"], state["model"]["t"])
    assert loaded["model"]["view"].untyped_storage().data_ptr() == loaded["model"]["w"].untyped_storage().data_ptr()
    assert torch.equal(loaded["ints"], state["ints"]) and loaded["nested"][1][2]["x"].shape == (2, 2)


def test_the_ring_holds_its_buffers_whatever_the_state_size():
    ring = stream.Ring(chunk=64 << 10, slots=2, copy_host=True)
    state = {f"w{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB, 1 MiB per tensor
    out = io.BytesIO()
    stream.save(state, out, ring)
    assert ring.copied == 8 << 20
    assert ring.nbytes == 2 * (64 << 10)  # 128 KiB of buffers carried 8 MiB
    assert out.getvalue() == torch_bytes(state)


def test_a_state_skip_data_cannot_save_falls_back_to_the_plain_path():
    with pytest.warns(UserWarning):  # torch deprecates quantized tensors
        q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    state = {"q": q, "w": torch.randn(4)}
    assert stream.storage_order(state) is None
    out = io.BytesIO()
    stream.save(state, out)
    assert out.getvalue() == torch_bytes(state)


def test_a_seek_torch_did_not_announce_is_refused():
    f = stream.StreamFile(io.BytesIO(), [torch.ones(2).untyped_storage()], stream.Ring())
    with pytest.raises(RuntimeError, match="unexpected seek"):
        f.seek(3, io.SEEK_CUR)
    with pytest.raises(RuntimeError, match="never written"):
        f.check_done()


def test_a_cancel_inside_torchs_writer_comes_out_as_the_cancel(tmp_path):
    """torch's zip writer masks an error of the file with its own ("unexpected pos"): the cancel is kept."""
    import threading

    from spotguard.errors import SaveCancelled

    cancel = threading.Event()
    cancel.set()
    f = DirectFile(tmp_path / "state.pt", buffer_size=1 << 20, cancel=cancel)
    with pytest.raises(SaveCancelled):
        with f:
            stream.save({"w": torch.randn(1 << 20)}, f)  # 4 MiB: the first full buffer meets the cancel


def test_pinned_torch_save_turns_torchs_setting_on_inside_the_block_only(monkeypatch):
    """What the trainer integrations wrap their trainer's own save in (the setting matters with CUDA only)."""
    from torch.utils.serialization import config

    before = config.save.use_pinned_memory_for_d2h
    with stream.pinned_torch_save():
        assert config.save.use_pinned_memory_for_d2h == before  # no CUDA here: left alone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with stream.pinned_torch_save():
        assert config.save.use_pinned_memory_for_d2h is True
    assert config.save.use_pinned_memory_for_d2h == before


def test_pinned_torch_save_works_before_anything_imported_torchs_serialization_config():
    """`import torch` leaves torch.utils.serialization out until the first torch.save: the block must
    import it itself, or a process's first trainer save goes through pageable memory (seen on an H200)."""
    code = (
        "import sys, torch\n"
        "assert 'torch.utils.serialization.config' not in sys.modules\n"
        "torch.cuda.is_available = lambda: True\n"
        "from spotguard.checkpoint.files import stream\n"
        "with stream.pinned_torch_save():\n"
        "    from torch.utils.serialization import config\n"
        "    assert config.save.use_pinned_memory_for_d2h is True\n"
        "assert config.save.use_pinned_memory_for_d2h is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_ring_copies_the_next_storages_chunks_while_one_is_written():
    """No drain at a storage's end: the copies run ahead into every free buffer, across storages."""
    ring = stream.Ring(chunk=4096, slots=3, copy_host=True)
    state = {f"w{i}": torch.randn(512) for i in range(6)}  # 2 KiB each: one chunk per storage
    seen: list[int] = []

    class Recording(io.BytesIO):
        def write(self, data):
            if len(memoryview(data)) == 2048:  # a storage's bytes (not a zip header)
                seen.append(ring.copied)
            return super().write(data)

    out = Recording()
    stream.save(state, out, ring)
    assert seen[0] == 3 * 2048  # storages 0, 1 and 2 copied before 0 was written
    assert seen[1] == 4 * 2048  # the freed buffer took storage 3 at once
    assert out.getvalue() == torch_bytes(state)
