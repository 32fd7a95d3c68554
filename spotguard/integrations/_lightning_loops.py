"""Lightning's private loops and attributes, reached in one place so that ``lightning.SpotguardCallback``
holds the callback alone: whether a validation follows the batch now ending, the fit's validation run
wrapped and its progress rewound in a checkpoint, an epoch's last batch resumed without counting the
epoch twice, the point where the resumed train loaders get their states (which the resume
checks first), and Lightning's SIGTERM handler set aside in a process group. Each finds what it needs
with ``getattr`` and leaves Lightning as it is where that has moved (with a warning where a resume then
differs): a change in a private API must not end the training."""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def validation_due(trainer: Any) -> bool:
    """Whether Lightning validates right after the batch now ending, as an uninterrupted run would.

    Asked at the batch's end, before a stop's ``trainer.should_stop`` counts: Lightning would also
    validate for that (an early stop), which a run that is not stopped does not do."""
    fit_loop = getattr(trainer, "fit_loop", None)
    loop = getattr(fit_loop, "epoch_loop", None)
    check = getattr(loop, "_should_check_val_fx", None)
    if check is None or trainer.sanity_checking:
        return False
    should_stop = trainer.should_stop
    try:
        trainer.should_stop = False
        return bool(check(getattr(fit_loop, "_data_fetcher", None)))
    except Exception as e:  # a private API of Lightning: a change there must not end the training
        logger.debug("cannot tell whether a validation follows this step: %s", e)
        return False
    finally:
        trainer.should_stop = should_stop


def wrap_validation(trainer: Any, around: Callable[[Callable[[], Any]], Any]) -> None:
    """Run each validation of ``fit`` as ``around(run)``, ``run`` being Lightning's own (once per loop).

    Lightning offers no hook before a validation's loader iterator exists (``on_validation_start``
    comes after it), nor one to skip a validation: the fit loop's validation loop's ``run`` is
    replaced. Where that loop is not found, validations run as Lightning's."""
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "val_loop", None)
    if loop is None or getattr(loop, "_spotguard_wrapped", False):
        return
    run = loop.run

    def run_around(*args: Any, **kwargs: Any) -> Any:
        return around(lambda: run(*args, **kwargs))

    loop.run = run_around
    loop._spotguard_wrapped = True


def rewind_validation(checkpoint: dict[str, Any], begun: bool) -> None:
    """Make a checkpoint saved during a validation (``begun``), or at a step whose validation comes
    next, run that validation from its first batch when resumed.

    Lightning resumes a cut validation as "mid-evaluation" but iterates its loader afresh and runs
    only the batches it counts as left: a shortened validation from the start, which draws fewer
    random numbers than the uninterrupted run's. A checkpoint of a step whose validation has not
    begun (saved at the batch's end, before Lightning validates) resumes past that validation:
    Lightning fast-forwards it. In both cases the progress is rewound here to "first batch started,
    none done", so the whole validation runs."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.val_loop.batch_progress")
    if not progress or "current" not in progress or "total" not in progress:
        logger.warning("Lightning's validation progress is not where expected: a cut validation is not repeated")
        return
    current, total = progress["current"], progress["total"]
    # the totals when this validation began (or begins: ``current`` is the previous one's then)
    before = {k: total[k] - current.get(k, 0) for k in total} if begun else dict(total)
    progress["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    progress["total"] = {
        "ready": before["ready"] + 1,
        "started": before["started"] + 1,
        "processed": before["processed"],
        "completed": before["completed"],
    }
    progress["is_last_batch"] = False
    if not begun:
        # Saved at the batch's end, so Lightning counts that batch once as it restarts there (its own comment:
        # the counter is never set before a save) and once more after the validation it now runs again.
        epoch = checkpoint["loops"]["fit_loop"].get("epoch_loop.state_dict", {})
        if isinstance(epoch.get("_batches_that_stepped"), int):
            epoch["_batches_that_stepped"] -= 1  # the logger's step: one ahead of the uninterrupted run's


def end_the_epoch_once(trainer: Any) -> None:
    """Make a fit resumed from a save at the end of an epoch's last batch end that epoch once.

    Lightning resumes such a checkpoint by counting the epoch done before it restarts it, then ends
    the restarted epoch (its loader has nothing left) and counts it done again: one epoch ahead of
    the uninterrupted run (its counters, each ``set_epoch``; with a ``DistributedSampler`` the next
    epoch skipped). Marked as not the last batch here, the epoch restarts with nothing left to train,
    validates if due and ends once, as the uninterrupted run's did; the next begins afresh. Called
    where the resumed fit's train loaders exist (their lengths known), after Lightning restored its
    loops. A loader cut by ``limit_train_batches`` has batches left: its restarted epoch is made to draw
    none; for a loader without a length the count is taken back instead (``settle_the_restarted_epoch``).
    A save made once the epoch's end was counted begins the next epoch instead (``_begin_the_next_epoch``)."""
    fit: Any = getattr(trainer, "fit_loop", None)
    loop: Any = getattr(fit, "epoch_loop", None)
    try:
        epochs, progress = fit.epoch_progress.total, loop.batch_progress
        batches = progress.total
        mid_epoch = epochs.started == epochs.ready == epochs.processed + 1 == epochs.completed + 1
        at_batch_end = batches.ready == batches.started == batches.processed == batches.completed + 1
        last, combined = progress.is_last_batch, fit._combined_loader
        lengths = [_length(dl) for dl in combined.flattened]
        limits = list(combined.limits or [])
        validation_next = loop.val_loop.batch_progress.current.started > loop.val_loop.batch_progress.current.processed
    except (AttributeError, TypeError) as e:  # a private API of Lightning: a change there must not end the training
        logger.warning("Lightning's loop progress is not where expected (%s): an epoch's end may count twice", e)
        return
    if epochs.ready == epochs.started == epochs.processed == epochs.completed > 0 and progress.current.ready:
        _begin_the_next_epoch(fit, loop)
        return
    if not (mid_epoch and at_batch_end and last):
        return
    if None in lengths or not limits or any(math.isinf(n) for n in limits):
        # No length: only the last batch's flag tells Lightning to validate at the epoch's end. It stays; the
        # count Lightning makes ahead of the restarted epoch's own end is taken back (``settle_the_restarted_epoch``).
        fit._spotguard_epoch_end = "counted"
        return
    progress.is_last_batch = False
    if limits != lengths:  # its loader has batches left, which the restarted epoch must not draw
        fit._spotguard_epoch_end = "cut"
    if not validation_next:
        _skip_once(loop.val_loop, "increment_progress_to_evaluation_end")


def _begin_the_next_epoch(fit: Any, loop: Any) -> None:
    """Saved once the epoch's end was counted (a stop between epochs: Lightning's SIGTERM raised outside a
    step), the epoch loop still holds that epoch's batches: Lightning would restart the finished epoch, draw
    nothing, end it and count it again (one epoch ahead). The uninterrupted run began the next epoch afresh
    here: the epoch loop's reset when it is not restarting, now, and a new iterator at the fit's start
    (``settle_the_restarted_epoch``), once the streams are restored, as that run's began the epoch."""
    try:  # all found before any is reset
        counts = (loop.batch_progress, loop.scheduler_progress, loop.automatic_optimization.optim_progress)
        validations = loop.val_loop.batch_progress.total  # it counts one epoch's validation batches
    except AttributeError as e:
        logger.warning("Lightning's epoch loop is not where expected (%s): an epoch's end may count twice", e)
        return
    for count in counts:
        count.reset_on_run()
    validations.reset()
    fit._spotguard_epoch_end = "ended"


def settle_the_restarted_epoch(trainer: Any) -> None:
    """At the fit's start, after Lightning's own restart (``end_the_epoch_once``): where ``limit_train_batches``
    left the loader with batches the uninterrupted run never trained, end the restarted epoch before it draws
    one (the next epoch's iterator is made afresh, as that run's was); for a loader without a length, take back
    the epoch Lightning counted done ahead of the restarted epoch's own end; after a save between epochs, make
    the next epoch's iterator now, the RNG streams restored (``_begin_the_next_epoch``)."""
    fit: Any = getattr(trainer, "fit_loop", None)
    how = getattr(fit, "_spotguard_epoch_end", None)
    if how is None:
        return
    fit._spotguard_epoch_end = None
    fetcher = getattr(fit, "_data_fetcher", None)
    if how == "ended" and fetcher is not None:
        iter(fetcher)  # the restored iterator gave its last batch: the next epoch's, from the next one
    elif how == "cut" and fetcher is not None:
        fetcher.done = True  # its next fetch raises StopIteration: the epoch ends there
    elif how == "counted":
        for tracker in (fit.epoch_progress.total, fit.epoch_progress.current):
            tracker.processed -= 1
            tracker.completed -= 1


def _length(loader: Any) -> int | None:
    """A loader's number of batches; None for one without (an iterable dataset's ``len`` raises)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _skip_once(obj: Any, name: str) -> None:
    """Make the next call of ``obj.name()`` do nothing. Here: Lightning counts a validation as done where its
    restarted epoch's position (the first batch) looks due for one, and makes its iterator to count it (a
    draw the uninterrupted run, which did not validate at that epoch's end, never made)."""

    def skipped(*args: Any, **kwargs: Any) -> None:
        del obj.__dict__[name]  # the class's method again

    setattr(obj, name, skipped)


def train_loaders(trainer: Any) -> dict[str, Any]:
    """The fit's train loaders whose state Lightning saves, by their index in its list of states."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    loaders = [dl for dl in getattr(combined, "flattened", None) or [] if _stateful(dl)]
    return {str(i): dl for i, dl in enumerate(loaders)}


def _stateful(obj: Any) -> bool:  # as Lightning's ``_Stateful``: what ``CombinedLoader._state_dicts`` saves
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def check_loader_states(trainer: Any, check: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Call ``check(loaders, states)`` where a resumed fit gives its train loaders their saved states
    (``fit_loop._load_combined_loader_states``, once the loaders exist), before it does; the states as
    ``check`` left them (moved to another worker count) are loaded. Lightning alone hands a state of
    another worker count to torchdata, which fails at the first batch, and one of another batch size
    without a word. There too, a resume at an epoch's last batch ends that epoch once (``end_the_epoch_once``)."""
    fit: Any = getattr(trainer, "fit_loop", None)
    load = getattr(fit, "_load_combined_loader_states", None)
    if load is None or not hasattr(fit, "_combined_loader_states_to_load"):
        logger.warning("Lightning's train loader states are not where expected: a resume does not check the loaders")
        return
    if getattr(fit, "_spotguard_checked", False):
        return

    def checked_load() -> Any:
        saved = fit._combined_loader_states_to_load
        if fit.restarting and saved and fit._combined_loader is not None:
            states = {str(i): state for i, state in enumerate(saved)}
            check(train_loaders(trainer), states)
            fit._combined_loader_states_to_load = [states[str(i)] for i in range(len(saved))]
        if fit.restarting:
            end_the_epoch_once(trainer)  # here, the loaders' lengths known
        return load()

    fit._load_combined_loader_states = checked_load
    fit._spotguard_checked = True


def bypass_lightning_sigterm(trainer: Any) -> None:
    """In a process group, give SIGTERM back to spotguard's handler (installed before Lightning's).

    Lightning's handler broadcasts from inside the signal handler and stops the rank that got the
    signal on its own; with a signal to one rank only the ranks fall out of step."""
    original = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", {}).get(signal.SIGTERM)
    if callable(original) and signal.getsignal(signal.SIGTERM) is not original:
        signal.signal(signal.SIGTERM, original)
