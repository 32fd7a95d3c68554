"""An abandoned async sharded save stops streaming its shard and commits nothing (one-rank gloo group)."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from torch import nn

from spotguard.checkpoint import scan
from spotguard.checkpoint.engine import Tracked
from spotguard.checkpoint.sharded.sharded import ShardedEngine
from spotguard.coordination.agreement import setup
from spotguard.errors import SaveCancelled
from tests.checkpoint.sharded.test_dcp import CancelMidStream

ITEM = 512 * 512 * 4  # bytes of one weight


@pytest.fixture
def agreement():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = setup(1, async_save=True)
    yield groups
    groups.close()
    dist.destroy_process_group()


def test_cancel_while_the_shard_streams_stops_it_and_is_reported_as_cancelled(tmp_path, agreement, monkeypatch):
    cancel = threading.Event()
    storage = CancelMidStream(
        str(tmp_path), cancel, after=1, only=".distcp", monkeypatch=monkeypatch
    )  # set by the first item
    commits: list = []
    engine = ShardedEngine(storage, agreement, keep=2, on_commit=commits.append)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(6)])
    work = engine.stage(Tracked({"model": model}, {}), 1, "periodic")
    with pytest.raises(SaveCancelled):
        work(cancel)
    assert storage.written < 2 * ITEM + 4096  # not all six weights: the writer stopped
    assert commits == [] and [i.status for i in scan(storage)] in ([], ["incomplete"])


def test_uncancelled_async_sharded_save_commits(tmp_path, agreement, monkeypatch):
    storage = CancelMidStream(str(tmp_path), threading.Event(), after=1 << 40, only=".distcp", monkeypatch=monkeypatch)
    commits: list = []
    engine = ShardedEngine(storage, agreement, keep=2, on_commit=commits.append)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(6)])
    engine.stage(Tracked({"model": model}, {}), 1, "periodic")(threading.Event())
    assert storage.written >= 6 * ITEM and len(commits) == 1
    assert [i.status for i in scan(storage)] == ["complete"]
