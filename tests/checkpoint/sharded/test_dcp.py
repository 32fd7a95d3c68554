"""SpotguardWriter, the DCP writer over spotguard storage: an abandoned save stops streaming."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from spotguard.checkpoint.files import fileio, filewrite
from spotguard.checkpoint.sharded.dcp import METADATA_FILE, SpotguardWriter, shard_file
from spotguard.errors import SaveCancelled
from spotguard.storage import LocalStorage

STEP = "step-00000001"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class CancelMidStream(LocalStorage):
    """Local storage on which an emergency 'arrives' once the checkpoint files named with ``only`` have
    been given ``after`` bytes (counted as their ``DirectFile`` accepts them)."""

    def __init__(self, url: str, cancel: threading.Event, after: int, only: str = "", *, monkeypatch) -> None:
        super().__init__(url)
        self.cancel, self.after, self.only, self.written = cancel, after, only, 0
        outer = self

        class Counting(fileio.DirectFile):
            def write(self, data):
                n = super().write(data)
                if outer.only in self.path.name:
                    outer.written += n
                    if outer.written >= outer.after:
                        outer.cancel.set()
                return n

        monkeypatch.setattr(filewrite, "DirectFile", Counting)


def state(n: int = 6) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256, 256), float(i)) for i in range(n)}  # 256 KiB each


def errors_of(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, CheckpointException):
        return [e for e, _ in exc.failures.values()]
    return [exc]


def test_writer_without_cancel_writes_every_item(tmp_path, monkeypatch):
    storage = CancelMidStream(str(tmp_path), threading.Event(), after=1 << 40, monkeypatch=monkeypatch)
    writer = SpotguardWriter(storage, STEP, 0)
    dcp.save(state(), storage_writer=writer, no_dist=True)
    assert {e.name for e in writer.entries} == {f"shards/{shard_file(0)}", f"shards/{METADATA_FILE}"}
    assert storage.written > 6 * 256 * 1024


def test_cancel_set_mid_stream_stops_before_the_next_item_and_leaves_no_file(tmp_path, monkeypatch):
    cancel = threading.Event()
    storage = CancelMidStream(str(tmp_path), cancel, after=1, monkeypatch=monkeypatch)  # set by the first bytes
    writer = SpotguardWriter(storage, STEP, 0, cancel=cancel)
    with pytest.raises((SaveCancelled, CheckpointException)) as info:
        dcp.save(state(), storage_writer=writer, no_dist=True)
    assert any(isinstance(e, SaveCancelled) for e in errors_of(info.value))
    assert storage.written < 2 * 256 * 1024 + 4096  # at most the item being written when it was set
    assert writer.entries == []
    assert storage.list_sizes("") == {}  # the partial shard's temp file is gone, no metadata written


def test_cancel_set_before_the_save_opens_no_file(tmp_path, monkeypatch):
    cancel = threading.Event()
    cancel.set()
    storage = CancelMidStream(str(tmp_path), threading.Event(), after=1 << 40, monkeypatch=monkeypatch)
    with pytest.raises((SaveCancelled, CheckpointException)) as info:
        dcp.save(state(), storage_writer=SpotguardWriter(storage, STEP, 0, cancel=cancel), no_dist=True)
    assert any(isinstance(e, SaveCancelled) for e in errors_of(info.value))
    assert storage.written == 0
    assert not (tmp_path / STEP).exists()


def test_cancel_set_inside_a_large_item_stops_within_a_piece_not_at_the_items_end(tmp_path, monkeypatch):
    """An abandoned sharded save gives the disk up to the emergency save within 16 MiB, even mid-tensor."""
    cancel = threading.Event()
    storage = CancelMidStream(str(tmp_path), cancel, after=1, only=".distcp", monkeypatch=monkeypatch)
    writer = SpotguardWriter(storage, STEP, 0, cancel=cancel)
    with pytest.raises((SaveCancelled, CheckpointException)) as info:
        dcp.save({"big": torch.ones(16 << 20)}, storage_writer=writer, no_dist=True)  # one 64 MiB item
    assert any(isinstance(e, SaveCancelled) for e in errors_of(info.value))
    assert storage.written <= (16 << 20) + 4096  # the piece being written when it was set, and a header
    assert storage.list_sizes("") == {}


def test_metadata_written_before_the_move_to_checkpoint_sharded_still_loads(tmp_path):
    # Until checkpoint/ had subpackages, the pickle named ShardLocation by spotguard.checkpoint.dcp.
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from spotguard.checkpoint.sharded.dcp import ShardLocation, load_metadata

    where = ShardLocation(shard_file(0), 8, 16)
    data = pickle.dumps(Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): where}), protocol=2)
    old = data.replace(b"spotguard.checkpoint.sharded.dcp\n", b"spotguard.checkpoint.dcp\n")
    assert old != data
    for i, blob in enumerate((data, old)):
        (tmp_path / f"{i}.dcp").write_bytes(blob)
        assert load_metadata(tmp_path / f"{i}.dcp").storage_data == {MetadataIndex("w"): where}
