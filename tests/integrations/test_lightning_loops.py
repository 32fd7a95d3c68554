"""The checkpoint rewrites in ``_lightning_loops`` on Lightning's own checkpoint layout (the trainer
runs that need them are in test_lightning.py and test_lightning_ddp.py)."""

from __future__ import annotations

import copy
import logging

from spotguard.integrations import _lightning_loops as loops


def progress(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def saved(epochs: dict[str, int], batches: dict[str, int], is_last_batch: bool) -> dict:
    """A Lightning checkpoint's loop progress, as ``trainer.save_checkpoint`` writes it."""
    return {
        "loops": {
            "fit_loop": {
                "epoch_progress": {"total": epochs, "current": dict(epochs)},
                "epoch_loop.batch_progress": {
                    "total": batches,
                    "current": dict(batches),
                    "is_last_batch": is_last_batch,
                },
            }
        }
    }


def test_a_batch_end_save_of_an_epochs_last_batch_is_not_counted_as_an_ended_epoch():
    ckpt = saved(progress(2, 2, 1, 1), progress(64, 64, 64, 63), is_last_batch=True)
    loops.end_the_epoch_once(ckpt)
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] is False


def test_other_saves_are_left_as_lightning_wrote_them():
    others = [
        saved(progress(2, 2, 1, 1), progress(40, 40, 40, 39), is_last_batch=False),  # mid-epoch
        saved(progress(2, 2, 2, 2), progress(64, 64, 64, 64), is_last_batch=True),  # after the epoch's end
        saved(progress(2, 2, 1, 1), progress(64, 64, 64, 64), is_last_batch=True),  # at the epoch loop's last save
    ]
    for ckpt in others:
        before = copy.deepcopy(ckpt)
        loops.end_the_epoch_once(ckpt)
        assert ckpt == before


def test_a_checkpoint_without_the_expected_progress_is_left_alone_with_a_warning(caplog):
    ckpt = {"loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}}}
    with caplog.at_level(logging.WARNING):
        loops.end_the_epoch_once(ckpt)
    assert ckpt == {"loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}}}
    assert "count it twice" in caplog.text
