"""Checkpoint files are written without torch.save's zip CRC32s (checkpoint/files/serialize.py), and load."""

from __future__ import annotations

import io
import threading
import zipfile

import pytest
import torch

from spotguard import Guard
from spotguard.checkpoint.files import serialize

pytestmark = pytest.mark.skipif(
    not hasattr(torch.serialization, "set_crc32_options"), reason="torch < 2.6 cannot switch the CRC32s off"
)


def crcs(blob: bytes) -> list[int]:
    return [i.CRC for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()]


@pytest.fixture(params=[True, False])
def setting(request):
    """The process-wide option as the user left it; restored after the test."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(request.param)
    yield request.param
    torch.serialization.set_crc32_options(before)


def test_saved_without_crcs_loads_and_leaves_the_users_setting_as_it_was(setting):
    value = {"w": torch.randn(64, 64), "step": 3}
    buf = io.BytesIO()
    serialize.save(value, buf)
    assert set(crcs(buf.getvalue())) == {0}
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert torch.equal(loaded["w"], value["w"]) and loaded["step"] == 3
    assert torch.serialization.get_crc32_options() is setting


def test_another_threads_save_after_our_first_write_keeps_its_crcs(setting):
    if not setting:
        pytest.skip("the user switched CRCs off")
    written = threading.Event()
    theirs = io.BytesIO()

    class Slow(io.BytesIO):
        def write(self, data):  # once our save is writing, another thread saves
            n = super().write(data)
            if not written.is_set():
                written.set()
                t = threading.Thread(target=torch.save, args=(torch.ones(8), theirs))
                t.start()
                t.join()
            return n

    ours = Slow()
    serialize.save(torch.zeros(8), ours)
    assert set(crcs(ours.getvalue())) == {0}
    assert 0 not in crcs(theirs.getvalue())


def test_a_failing_write_restores_the_setting_and_frees_the_next_save(setting):
    class Broken(io.BytesIO):
        def write(self, data):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        serialize.save(torch.zeros(8), Broken())
    assert torch.serialization.get_crc32_options() is setting
    done = threading.Event()
    threading.Thread(target=lambda: (serialize.save(torch.zeros(8), io.BytesIO()), done.set()), daemon=True).start()
    assert done.wait(10), "the switch's lock was left held"


def test_a_guard_checkpoint_file_has_no_crcs_and_resumes(tmp_path):
    model = torch.nn.Linear(32, 16)
    Guard(str(tmp_path), providers=None).track(model=model).save(5)
    (state,) = tmp_path.glob("step-*/state.pt")
    assert set(crcs(state.read_bytes())) == {0}
    other = torch.nn.Linear(32, 16)
    assert Guard(str(tmp_path), providers=None).track(model=other).resume() == 5
    assert torch.equal(other.weight, model.weight)
