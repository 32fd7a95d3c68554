"""``_lightning_loops.end_the_epoch_once`` on Lightning's own progress objects (the trainer runs that need it
are in test_lightning.py and test_lightning_ddp.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from spotguard.integrations import _lightning_loops as loops

progress = pytest.importorskip("lightning.pytorch.loops.progress")


def tracker(ready: int, started: int, processed: int, completed: int) -> object:
    return progress._ProcessedTracker(ready=ready, started=started, processed=processed, completed=completed)


def fit_loop(epochs: tuple, batches: tuple, last: bool, limits: list, lengths: list, validation_next: bool = False):
    """A resumed fit's loops as Lightning restored them, and its train loaders (``len`` only)."""
    epoch_progress = progress._Progress(total=tracker(*epochs), current=tracker(*epochs))
    batch_progress = progress._BatchProgress(total=tracker(*batches), current=tracker(*batches), is_last_batch=last)
    val = progress._BatchProgress(current=tracker(1, 1, 0, 0) if validation_next else tracker(4, 4, 4, 4))
    val_loop = SimpleNamespace(batch_progress=val)
    loaders = [list(range(n)) if n is not None else iter(()) for n in lengths]
    optimization = SimpleNamespace(optim_progress=progress._OptimizationProgress())
    epoch_loop = SimpleNamespace(
        batch_progress=batch_progress,
        val_loop=val_loop,
        scheduler_progress=progress._SchedulerProgress(),
        automatic_optimization=optimization,
    )
    return SimpleNamespace(
        epoch_progress=epoch_progress,
        epoch_loop=epoch_loop,
        _combined_loader=SimpleNamespace(flattened=loaders, limits=limits),
    )


LAST_BATCH = {"epochs": (2, 2, 1, 1), "batches": (64, 64, 64, 63), "last": True}


def test_a_batch_end_save_of_an_epochs_last_batch_is_not_counted_as_an_ended_epoch():
    fit = fit_loop(**LAST_BATCH, limits=[32], lengths=[32], validation_next=True)
    loops.end_the_epoch_once(SimpleNamespace(fit_loop=fit))
    assert fit.epoch_loop.batch_progress.is_last_batch is False
    assert "increment_progress_to_evaluation_end" not in vars(fit.epoch_loop.val_loop)  # the validation runs


def test_without_a_validation_next_the_restarted_epoch_counts_none_done_once():
    fit = fit_loop(**LAST_BATCH, limits=[32], lengths=[32])
    loops.end_the_epoch_once(SimpleNamespace(fit_loop=fit))
    val_loop = fit.epoch_loop.val_loop
    assert fit.epoch_loop.batch_progress.is_last_batch is False
    assert val_loop.increment_progress_to_evaluation_end() is None  # skipped once, then the class's method again
    assert "increment_progress_to_evaluation_end" not in vars(val_loop)


@pytest.mark.parametrize(
    "case",
    [
        dict(epochs=(2, 2, 1, 1), batches=(40, 40, 40, 39), last=False, limits=[32], lengths=[32]),  # mid-epoch
        dict(**LAST_BATCH, limits=[float("inf")], lengths=[None]),  # no length: the flag says validate at the end
    ],
    ids=["mid-epoch", "no-length"],
)
def test_other_resumes_are_left_as_lightning_restored_them(case):
    fit = fit_loop(**case)
    loops.end_the_epoch_once(SimpleNamespace(fit_loop=fit))
    assert fit.epoch_loop.batch_progress.is_last_batch is case["last"]
    assert "increment_progress_to_evaluation_end" not in vars(fit.epoch_loop.val_loop)


ENDED = {"epochs": (2, 2, 2, 2), "batches": (64, 64, 64, 64), "last": True, "limits": [32], "lengths": [32]}


class Fetcher:
    """Lightning's data fetcher, as far as a new epoch's iterator goes."""

    iterators = 0

    def __iter__(self):
        self.iterators += 1
        return iter(())


def test_a_save_after_an_epochs_end_begins_the_next_epoch_afresh():
    fit = fit_loop(**ENDED)
    loop = fit.epoch_loop
    loop.scheduler_progress.increment_ready()
    loop.automatic_optimization.optim_progress.optimizer.step.increment_ready()
    loop.val_loop.batch_progress.total.ready = 12
    trainer = SimpleNamespace(fit_loop=fit)
    loops.end_the_epoch_once(trainer)
    assert loop.batch_progress.current == tracker(0, 0, 0, 0) and loop.batch_progress.is_last_batch is False
    assert loop.batch_progress.total == tracker(64, 64, 64, 64)  # the run's count of batches stays
    assert loop.scheduler_progress.current.ready == 0 and loop.scheduler_progress.total.ready == 1
    assert loop.automatic_optimization.optim_progress.optimizer.step.current.ready == 0
    assert loop.val_loop.batch_progress.total.ready == 0  # one epoch's validation batches
    assert fit.epoch_progress.total == tracker(2, 2, 2, 2)  # the next epoch is Lightning's to begin
    fit._data_fetcher = Fetcher()  # made after the loaders' states are loaded: its iterator is spent
    loops.settle_the_restarted_epoch(trainer)
    assert fit._data_fetcher.iterators == 1  # a new iterator: the next epoch's batches
    loops.settle_the_restarted_epoch(trainer)  # once only
    assert fit._data_fetcher.iterators == 1


def test_an_epoch_loop_not_where_expected_is_left_as_restored(caplog):
    fit = fit_loop(**ENDED)
    del fit.epoch_loop.scheduler_progress
    with caplog.at_level(logging.WARNING):
        loops.end_the_epoch_once(SimpleNamespace(fit_loop=fit))
    assert fit.epoch_loop.batch_progress.current == tracker(64, 64, 64, 64)  # nothing reset
    assert fit.epoch_loop.batch_progress.is_last_batch is True
    assert "an epoch's end may count twice" in caplog.text


def test_an_epoch_cut_by_limit_train_batches_is_ended_before_its_restart_draws():
    fit = fit_loop(**LAST_BATCH, limits=[4], lengths=[32])  # the loader has 28 batches left
    trainer = SimpleNamespace(fit_loop=fit)
    loops.end_the_epoch_once(trainer)
    assert fit.epoch_loop.batch_progress.is_last_batch is False
    fit._data_fetcher = SimpleNamespace(done=False)  # made after the loaders' states are loaded
    loops.settle_the_restarted_epoch(trainer)
    assert fit._data_fetcher.done is True  # its next fetch ends the restarted epoch
    fit._data_fetcher.done = False
    loops.settle_the_restarted_epoch(trainer)  # once only
    assert fit._data_fetcher.done is False


def test_without_a_length_the_epoch_lightning_counts_ahead_is_taken_back():
    fit = fit_loop(**LAST_BATCH, limits=[float("inf")], lengths=[None])
    trainer = SimpleNamespace(fit_loop=fit)
    loops.end_the_epoch_once(trainer)
    for tracker in (fit.epoch_progress.total, fit.epoch_progress.current):  # Lightning's reset, then
        tracker.processed, tracker.completed = 2, 2
    loops.settle_the_restarted_epoch(trainer)
    assert (fit.epoch_progress.total.processed, fit.epoch_progress.total.completed) == (1, 1)
    assert (fit.epoch_progress.current.processed, fit.epoch_progress.current.completed) == (1, 1)
    loops.settle_the_restarted_epoch(trainer)  # once only
    assert fit.epoch_progress.total.completed == 1


def test_a_whole_epoch_is_not_ended_early():
    fit = fit_loop(**LAST_BATCH, limits=[32], lengths=[32])
    loops.end_the_epoch_once(SimpleNamespace(fit_loop=fit))
    fit._data_fetcher = SimpleNamespace(done=False)
    loops.settle_the_restarted_epoch(SimpleNamespace(fit_loop=fit))
    assert fit._data_fetcher.done is False  # its spent iterator ends it


def test_loops_not_where_expected_are_left_alone_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        loops.end_the_epoch_once(SimpleNamespace(fit_loop=SimpleNamespace()))
    assert "count twice" in caplog.text
