"""Fixtures of the folder tests: the two checkpoint engines, and a trainer's own checkpoint folders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(params=["single", "sharded"])
def engine(request):
    """No process group (one file per checkpoint), or a one-rank gloo group (sharded: DCP shards, rank files)."""
    if request.param == "sharded":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield request.param
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def trainer_folder(tmp_path) -> Callable[[int], Path]:
    """``folder(step)``: a trainer's ``checkpoint-STEP/`` as HF, Lightning, Accelerate and DeepSpeed write
    it, for ``FolderCheckpoints.commit`` (one file of 4 KiB whose bytes name the step)."""

    def folder(step: int) -> Path:
        out = tmp_path / "out" / f"checkpoint-{step}"
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(bytes([step]) * 4096)
        return out

    return folder
