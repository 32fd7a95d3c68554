"""A tracked StatefulDataLoader that changed since the save: refused once with both values, or accepted on purpose."""

from __future__ import annotations

import logging
import multiprocessing
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import spotguard
from spotguard import heartbeat
from spotguard.checkpoint.state import data, workers
from spotguard.errors import CheckpointMismatchError

DATA = list(range(24))


# Workers start by forkserver, not fork: the pytest worker may already run threads (a watcher, gloo)
# from earlier tests, and a forked child can deadlock on a lock one of them held (seen once: a hang).
# The forkserver imports what a worker unpickles its dataset with once, not each worker (a loader's
# workers start again every epoch): without it each paid `import torch`, 5-7 s a test here.
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["torch", "torchdata.stateful_dataloader", "numpy", "spotguard"])
WORKER_START = {"multiprocessing_context": FORKSERVER}


def loader(workers: int = 0, batch_size: int = 2, dataset: Any = DATA, seed: int = 3, **kw: Any) -> StatefulDataLoader:
    """A shuffled loader of ``dataset``, its order drawn from a generator of its own (``seed``)."""
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        **(WORKER_START if workers else {}),
        **kw,
    )


def saved_after(tmp_path, batches: int, **kw) -> list[int]:
    """Save a guard's loader after ``batches`` batches; return the samples an uninterrupted run sees after them."""
    first = loader(**kw)
    guard = spotguard.Guard(str(tmp_path), providers=[]).track(loader=first)
    it = iter(first)
    for _ in range(batches):
        next(it)
    guard.save(batches)
    return [x for batch in it for x in batch.tolist()]


def resumed(tmp_path, new: StatefulDataLoader, **kw) -> spotguard.Guard:
    guard = spotguard.Guard(str(tmp_path), providers=[], **kw).track(loader=new)
    guard.resume()
    return guard


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 1), (1, 2)])
def test_another_number_of_workers_continues_at_the_same_sample(tmp_path, caplog, before, after):
    rest = saved_after(tmp_path, 3, workers=before)
    new = loader(after)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        resumed(tmp_path, new)  # was: torchdata's bare AssertionError at the first batch, on every restart
    assert f"saved with num_workers={before} and has num_workers={after} now: it continues at the same sample" in (
        caplog.text
    )
    # Between 0 and 1+ workers the later epochs' shuffle changes too (the workers' seed is drawn from the
    # loader's generator): said; between two counts of workers it does not.
    assert ("from the next epoch on it also shuffles otherwise" in caplog.text) == ((before == 0) != (after == 0))
    assert [x for b in new for x in b.tolist()] == rest


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(12))


def test_a_position_that_cannot_move_to_another_worker_count_is_refused_once_with_both_counts(tmp_path):
    first = StatefulDataLoader(Stream(), batch_size=2)
    guard = spotguard.Guard(str(tmp_path), providers=[]).track(loader=first)
    it = iter(first)
    next(it)
    guard.save(1)
    again = spotguard.Guard(str(tmp_path), providers=[]).track(
        loader=StatefulDataLoader(Stream(), batch_size=2, num_workers=1)
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'loader' was saved with num_workers=0 and has num_workers=1 now; .*its dataset keeps a state "
        r".*Resume with num_workers=0",
    ):
        again.resume()
    assert again._beat.flags & heartbeat.CONFIG_ERROR  # `spotguard run` exits 78 instead of restarting


@pytest.mark.timeout(120)
def test_the_worker_count_is_read_from_the_state_of_a_checkpoint_that_did_not_record_it():
    for count in (0, 2):
        ld = loader(count)
        it = iter(ld)
        next(it)
        assert data.saved_workers(ld.state_dict()) == count
        del it
    assert data.saved_workers({"something": 1}) is None


def test_another_batch_size_is_refused_with_both_sizes(tmp_path):
    saved_after(tmp_path, 3, batch_size=2)
    with pytest.raises(CheckpointMismatchError, match=r"batch_size=2 and has batch_size=4 now.*rebatch='accept'"):
        resumed(tmp_path, loader(batch_size=4))


def test_rebatch_accept_continues_at_the_same_sample_in_the_new_batches(tmp_path, caplog):
    rest = saved_after(tmp_path, 3, batch_size=2)
    new = loader(batch_size=4)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        resumed(tmp_path, new, rebatch="accept")
    assert "saved with batch_size=2 and has batch_size=4 now (rebatch='accept')" in caplog.text
    batches = [b.tolist() for b in new]
    assert [len(b) for b in batches] == [4, 4, 4, 4, 2]
    assert [x for b in batches for x in b] == rest  # the very samples the uninterrupted run had left


def test_an_unchanged_loader_resumes_without_a_word(tmp_path, caplog):
    rest = saved_after(tmp_path, 3)
    new = loader()
    with caplog.at_level(logging.WARNING, logger="spotguard"), warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed(tmp_path, new)
    assert "batch_size" not in caplog.text
    assert [x for b in new for x in b.tolist()] == rest


@pytest.mark.parametrize("kw", [{}, {"workers": 2, "persistent_workers": True}], ids=["no-workers", "persistent"])
def test_a_throwaway_iterator_that_took_the_restored_position_is_named(tmp_path, caplog, kw):
    """PyTorch's DDP tutorial reads its batch size with ``len(next(iter(loader))[0])`` at each epoch's start.
    After a mid-epoch resume that peek takes the restored position, and the ``for`` loop's iterator starts
    the epoch over: silently another run. Loops that use the restored iterator say nothing, also when it
    was saved at the epoch's last batch (it yields nothing, then the next epoch starts). A loader with
    persistent workers resets its one iterator instead of making another: the same peek, the same words."""
    rest = saved_after(tmp_path / "mid", 3, **kw)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        resumed(tmp_path / "mid", peeked := loader(**kw))
        assert len(next(iter(peeked))) == 2
        assert [x for b in peeked for x in b.tolist()] != rest  # the epoch over, from its first batch
    assert "was dropped after 1 batch(es)" in caplog.text, caplog.text
    saved_after(tmp_path / "end", 12, **kw)  # 12 batches of 2: the epoch's last
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        for where, epoch in (("mid", rest), ("end", [])):
            resumed(tmp_path / where, new := loader(**kw))
            assert [x for b in new for x in b.tolist()] == epoch  # the restored iterator, to its end
            assert sorted(x for b in new for x in b.tolist()) == DATA  # then the next epoch, whole
    assert "dropped" not in caplog.text, caplog.text


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_resume_refuses_another_batch_size_on_every_rank(tmp_path, group):
    first = loader(batch_size=2)
    guard = spotguard.Guard(str(tmp_path), providers=[], async_save=False).track(loader=first)
    it = iter(first)
    next(it)
    guard.save(1)
    guard.close(save=False)
    again = spotguard.Guard(str(tmp_path), providers=[]).track(loader=loader(batch_size=3))
    try:
        with pytest.raises(CheckpointMismatchError, match=r"rank 0: .*batch_size=2 and has batch_size=3 now"):
            again.resume()
    finally:
        again.close(save=False)


@pytest.mark.timeout(120)
def test_a_snapshot_older_than_the_last_batch_is_not_moved():
    ld = StatefulDataLoader(DATA, batch_size=2, num_workers=1, snapshot_every_n_steps=3, **WORKER_START)
    it = iter(ld)
    for _ in range(4):
        next(it)
    moved, why = workers.convert(ld.state_dict(), 0)
    assert moved is None and "snapshot_every_n_steps" in why
    assert workers.convert({"what": 1}, 2) == (None, "its state is not in a layout this spotguard knows")
