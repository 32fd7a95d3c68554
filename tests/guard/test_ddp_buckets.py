"""Four DDP ranks (gloo) resume bit for bit: a fresh DDP would reduce its first step's gradients in
another bucket layout than the one the uninterrupted run rebuilt after its first step, and with 3+
ranks the sums differ in the last bits (spotguard.guard.buckets)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spotguard.checkpoint import delete, latest, scan
from spotguard.guard import buckets
from spotguard.storage import open_storage
from tests.forked import behind
from tests.helpers import EXAMPLE_DDP, ddp_example_cmd, read_losses, run

RANKS, STEPS, EVERY = 4, 24, 8


def test_one_rank_keeps_ddps_own_buckets():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
        assert buckets.pin([ddp, torch.nn.Linear(2, 2)]) == 0
        ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.reducer._rebuild_buckets()  # still DDP's own rebuild, in gradient-ready order
    finally:
        dist.destroy_process_group()


@pytest.fixture
def forked_ranks():
    """torchrun's four ranks fork from one server that imported the example (tests/forked.py)."""
    with behind(EXAMPLE_DDP):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("forked_ranks")
def test_four_ranks_resumed_from_a_periodic_checkpoint_train_bit_for_bit_like_the_uninterrupted_run(tmp_path):
    storage = tmp_path / "ckpt"
    args = ("--steps", str(STEPS), "--every-steps", str(EVERY), "--providers", "signal", "--keep", "5")
    whole = run(ddp_example_cmd(RANKS, storage, *args, "--losses", str(tmp_path / "ref-{rank}.jsonl")))
    assert whole.returncode == 0, whole.stderr[-3000:]

    # Back to the uninterrupted run's own checkpoint of step 8: the resume replays steps 9..24.
    store = open_storage(str(storage))
    for info in scan(store):
        if info.step > EVERY:
            delete(store, info.name)
    info = latest(store)
    assert info and info.step == EVERY and info.manifest.world_size == RANKS
    again = run(ddp_example_cmd(RANKS, storage, *args, "--losses", str(tmp_path / "again-{rank}.jsonl")))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming at step {EVERY}" in again.stdout

    differ = []  # (rank, step, loss, reference loss)
    for r in range(RANKS):
        want = dict(read_losses(tmp_path / f"ref-{r}.jsonl"))
        got = read_losses(tmp_path / f"again-{r}.jsonl")
        assert [step for step, _ in got] == list(range(EVERY + 1, STEPS + 1))
        differ += [(r, step, loss, want[step]) for step, loss in got if loss != want[step]]
    assert differ == []


def test_pinning_by_default_only_where_it_costs_no_overlap():
    first = dist._DEFAULT_FIRST_BUCKET_BYTES  # DDP reduces this bucket after the whole backward pass
    assert buckets.is_free(first) and not buckets.is_free(first + 1)
    assert buckets.is_free(first // 4, first_bucket=first // 4) and not buckets.is_free(first // 2, first // 4)
