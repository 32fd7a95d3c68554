"""A Trainer's folder committed to a local storage shares its files with the checkpoint (hard links): the
Trainer must never write those files again in place, which would change committed bytes under their manifest.

In process, a real Trainer (``hf_train`` of tests/integrations/test_untracked.py): a second run started from
scratch in the first one's ``output_dir``, and an advisory notice at a step already committed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spotguard import checkpoint
from spotguard.coordination.agreement import ADVISORY
from spotguard.storage import open_storage
from tests.integrations.test_untracked import hf_train

transformers = pytest.importorskip("transformers")


def test_a_new_run_in_an_old_runs_output_dir_leaves_its_committed_checkpoints_intact(tmp_path):
    storage_dir, out = tmp_path / "ckpt", tmp_path / "out"
    assert hf_train(storage_dir, out, callbacks=[], max_steps=4) == 0
    storage = open_storage(str(storage_dir))
    committed = {info.step: info for info in checkpoint.scan(storage)}
    assert {2, 4} <= set(committed) and (out / "checkpoint-2" / "model.safetensors").stat().st_nlink > 1
    checked: list[int] = []

    class VerifyCommitted(transformers.TrainerCallback):
        """Runs before spotguard's ``on_save``: right after the Trainer wrote ``checkpoint-N`` again."""

        def on_save(self, args, state, control, **kwargs):
            for info in committed.values():
                checkpoint.verify(storage, info)  # raises when a rewrite reached the committed bytes
            checked.append(state.global_step)

    # Another run from step 0 (another seed: other bytes) over the same folder and storage, without resuming.
    assert hf_train(storage_dir, out, callbacks=[], max_steps=4, seed=1, plain=[VerifyCommitted()]) == 0
    assert checked == [2, 4]
    for info in committed.values():
        checkpoint.verify(storage, info)


def test_an_advisory_at_a_committed_step_asks_the_trainer_for_no_second_save(tmp_path):
    # An epoch-end evaluation after the step's own save: an advisory notice there must not save the step again.
    from spotguard.integrations.hf import SpotguardCallback

    cb = SpotguardCallback(str(tmp_path / "ckpt"), providers=[], lease_ttl=None)
    try:
        control = SimpleNamespace(should_save=False, should_training_stop=False)
        cb._committed_step = 8
        assert cb._act(ADVISORY, SimpleNamespace(global_step=8), control) and not control.should_save
        assert cb._act(ADVISORY, SimpleNamespace(global_step=9), control) and control.should_save
    finally:
        cb.close()


def test_a_stop_in_the_evaluation_at_start_asks_for_no_save_of_the_step_it_began_at(tmp_path, caplog):
    """``eval_on_start=True`` with the callback added to a Trainer the user runs: a notice in that evaluation
    set ``should_save``, which the Trainer drops before its first step. The log said "writing the emergency
    checkpoint", none was written, and the job exited 75 as if one had committed. Step 0 of a fresh start
    (or the step a run resumed at) is its resume point already: nothing to write."""
    from spotguard.coordination.agreement import STOP
    from spotguard.integrations.hf import SpotguardCallback

    for resumed in (0, 12):
        cb = SpotguardCallback(str(tmp_path / "ckpt"), providers=[], lease_ttl=None)
        try:
            control = SimpleNamespace(should_save=False, should_training_stop=False)
            cb._resumed_step = resumed  # as on_train_begin sets it
            assert cb._act(STOP, SimpleNamespace(global_step=resumed), control)
            assert not control.should_save and control.should_training_stop and cb.stopped_at == resumed
        finally:
            cb.close()
    assert "stop at step 0: nothing trained yet, no checkpoint needed" in caplog.text
    assert "stop at step 12: already checkpointed" in caplog.text
    assert "writing the emergency checkpoint" not in caplog.text
