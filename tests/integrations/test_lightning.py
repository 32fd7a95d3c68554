"""Lightning + SpotguardCallback: stopped by SIGTERM, a cloud notice, during validation and during
warm-up, resumed each time with ckpt_path, and equal to an uninterrupted run bit for bit."""

from __future__ import annotations

import logging
import random
import signal

import pytest
import torch

from spotguard.checkpoint import scan
from spotguard.errors import StorageError
from spotguard.ops.rehearsal.compare import compare
from spotguard.storage import LocalStorage

from ..helpers import after_step, last_step
from . import runs
from .test_untracked import lightning_fit, quiet_trainer

pytest.importorskip("lightning")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.slow

SCRIPT = "lightning_train.py"
STEPS = 70
# 32 batches per epoch: the run crosses two epoch ends; saves every 15 steps, validations (4 batches) every 10.
ARGS = ("--steps", str(STEPS), "--every-steps", "15", "--eval-steps", "10", "--interval", "0.2")
# Validations that draw random numbers (noisy inputs): a validation skipped or shortened by a resume
# leaves the streams elsewhere, and every later step differs.
AUGMENTED = (*ARGS, "--eval-augment")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with runs.forked(SCRIPT):  # the example's runs fork from one server: one start, one import of each library
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("lightning-reference"), *ARGS)


def test_lightning_resumes_identically_after_sigterm_and_a_cloud_notice(tmp_path, reference, mock_metadata):
    runs.stop_by_signal_then_cloud_notice(SCRIPT, tmp_path, ARGS, STEPS, mock_metadata, _rng)
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
    assert_same_final_checkpoint(tmp_path, reference)  # step 70: no multiple of every 15


def test_a_sigterm_after_an_epochs_last_step_stops_between_epochs_and_resumes_exactly(tmp_path, reference):
    """Lightning raises its SIGTERM once the epoch's end is counted: the checkpoint holds the finished epoch's
    batches, which Lightning would restart and count again (the final checkpoint one epoch ahead)."""
    stopped = runs.stop_when(
        SCRIPT, tmp_path, (*ARGS, *runs.SLOW), after_step(tmp_path / "losses.jsonl", 32), runs.sigterm
    )
    assert runs.assert_stopped(stopped, tmp_path) == 32 and "outside a training step after step 32" in stopped.stderr
    runs.finish_identically(SCRIPT, tmp_path, ARGS, reference)
    assert_same_final_checkpoint(tmp_path, reference)


def test_save_on_exit_false_leaves_the_last_steps_uncommitted(tmp_path):
    steps = {}
    for save_on_exit in (True, False):
        run_dir = tmp_path / str(save_on_exit)
        assert lightning_fit(run_dir / "ckpt", scheduler=False, max_steps=3, save_on_exit=save_on_exit)[0] == 0
        steps[save_on_exit] = [(i.step, i.manifest.reason) for i in runs.checkpoints(run_dir)]
    assert steps == {True: [(2, "periodic"), (3, "final")], False: [(2, "periodic")]}


def assert_same_final_checkpoint(run_dir, reference, steps: int = STEPS) -> None:
    """The stored final checkpoint equals the uninterrupted run's, every value of Lightning's ``.ckpt``
    (its loops' counters included) bit for bit; a finished fit stores its last step (``save_on_exit``)."""
    newest = max((i for i in runs.checkpoints(run_dir) if i.complete), key=lambda i: (i.step, i.name))
    assert newest.step == steps and newest.manifest.reason == "final", newest
    same = compare(str(run_dir / "ckpt"), str(reference[1].parent / "ckpt"))
    assert same.exact and same.compared > 100, same.line()


@pytest.fixture(scope="module")
def reference_augmented(tmp_path_factory):
    return runs.reference_run(SCRIPT, tmp_path_factory.mktemp("lightning-reference-augmented"), *AUGMENTED)


def test_lightning_notice_during_validation_and_warmup_still_checkpoints(tmp_path, reference_augmented):
    # Not at 30 or 60: there the periodic checkpoint, written before the validation, is already the step's.
    # The cut validation draws random numbers: the resume repeats it whole, from the streams it began with.
    in_eval = runs.stop_during_evaluation_then_warmup(SCRIPT, tmp_path, AUGMENTED, [20, 40], 4, _rng)
    assert "during validation" in in_eval.stderr
    runs.finish_identically(SCRIPT, tmp_path, AUGMENTED, reference_augmented)
    assert_same_final_checkpoint(tmp_path, reference_augmented)


def test_lightning_resumes_a_checkpoint_of_a_step_that_validates_into_that_validation(tmp_path, reference_augmented):
    # Step 30 saves (every 15) and validates (every 10); the save comes first. A crash after it
    # resumes from 30, and Lightning's own resume would skip that validation and its random draws.
    def past_30() -> bool:
        return (last_step(tmp_path / "losses.jsonl") or 0) >= 32

    crashed = runs.stop_when(SCRIPT, tmp_path, AUGMENTED, past_30, lambda p: p.send_signal(signal.SIGKILL))
    assert crashed.returncode == -signal.SIGKILL
    complete = [i.step for i in runs.checkpoints(tmp_path) if i.status == "complete"]
    assert max(complete) == 30, complete  # the resume point is the step that validates
    runs.finish_identically(SCRIPT, tmp_path, AUGMENTED, reference_augmented)
    assert_same_final_checkpoint(tmp_path, reference_augmented)


# Saves every 16 steps: step 32 is the first epoch's last batch (32 batches an epoch). Without and with
# a validation due there (every 16 steps, or at each epoch's end as Lightning's default; noisy inputs): the
# resume must end that epoch as the uninterrupted run did, not count it twice (Lightning's own resume of a
# batch-end save at an epoch's end).
EPOCH_END = {
    "no-validation": ("--steps", "40", "--every-steps", "16", "--interval", "0.2"),
    "validation-next": ("--steps", "40", "--every-steps", "16", "--eval-steps", "16", "--eval-augment"),
    "epoch-end-validation": ("--steps", "40", "--every-steps", "16", "--eval-epochs", "--eval-augment"),
}


@pytest.mark.parametrize("case", sorted(EPOCH_END))
def test_a_crash_after_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path_factory, case):
    args = EPOCH_END[case]
    reference = runs.reference_run(SCRIPT, tmp_path_factory.mktemp("reference"), *args)
    run_dir = tmp_path_factory.mktemp("run")

    def past_32() -> bool:
        return (last_step(run_dir / "losses.jsonl") or 0) >= 34

    crashed = runs.stop_when(SCRIPT, run_dir, args, past_32, lambda p: p.send_signal(signal.SIGKILL))
    assert crashed.returncode == -signal.SIGKILL
    assert max(i.step for i in runs.checkpoints(run_dir) if i.complete) == 32
    runs.finish_identically(SCRIPT, run_dir, args, reference)
    assert_same_final_checkpoint(run_dir, reference, steps=40)  # the epoch counters too


class _Fails(LocalStorage):
    """Local storage whose commit of one step fails."""

    def __init__(self, root, step: int) -> None:
        super().__init__(root)
        self.step = step

    def put_bytes(self, key, data, **kw):
        if key.startswith(f"step-{self.step:08d}"):
            raise StorageError(f"{key}: refused (test)")
        return super().put_bytes(key, data, **kw)


def test_a_final_checkpoint_that_fails_fails_the_fit_where_a_periodic_one_is_logged(tmp_path, caplog):
    # As Guard's and the HF callback's: a fit that ends with its model only on a machine about to go is no
    # success. A failed periodic save is logged and training goes on (periodic every 2 steps; 5 is the last).
    with pytest.raises(StorageError, match="refused"):
        lightning_fit(_Fails(str(tmp_path / "final"), 5), scheduler=False, max_steps=5)
    assert [i.step for i in scan(LocalStorage(str(tmp_path / "final"))) if i.complete] == [2, 4]
    with caplog.at_level(logging.ERROR, logger="spotguard"):
        code, _ = lightning_fit(_Fails(str(tmp_path / "periodic"), 2), scheduler=False, max_steps=5)
    assert code == 0 and "periodic checkpoint of step 2 NOT committed" in caplog.text, caplog.text
    assert [i.step for i in scan(LocalStorage(str(tmp_path / "periodic"))) if i.complete] == [4, 5]


def _small_fit(storage, max_steps: int, stream: bool = False, **limits) -> int:
    """8 batches an epoch (or ``limit_train_batches``), validations with noisy inputs, dropout in training; no
    periodic save: a fit to ``max_steps`` at an epoch's end ends with a batch-end save of its last batch.
    ``stream``: the train data an iterable dataset without a length (Lightning knows its end only there)."""
    L = pytest.importorskip("lightning.pytorch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from spotguard.integrations.lightning import SpotguardCallback

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            noisy = batch[0] + 0.1 * torch.randn_like(batch[0])
            return torch.nn.functional.mse_loss(self.net(noisy), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(list(zip(x, y, strict=True)))

    data = torch.utils.data.TensorDataset(x, y)
    trainer = quiet_trainer(max_steps, num_sanity_val_steps=0, check_val_every_n_epoch=1, **limits)
    cb = SpotguardCallback(str(storage), providers=[], lease_ttl=None)
    train = (
        StatefulDataLoader(Stream(), batch_size=2) if stream else StatefulDataLoader(data, batch_size=2, shuffle=True)
    )
    val = StatefulDataLoader(data, batch_size=4)
    return cb.fit(trainer, Module(), train_dataloaders=train, val_dataloaders=val)


# Validations every 3 batches, none at the epoch's last (8): restarted at its first batch position, the epoch looked
# due for one, and Lightning counted one as done, making its iterator: a random draw the uninterrupted run never
# made. 4 batches an epoch of the loader's 8 (limit_train_batches), validations at each epoch's end: the restarted
# epoch trained the loader's batches 5 to 8, which the uninterrupted run never trained. A loader without a length,
# validations at each epoch's end: Lightning counted the epoch done twice (one epoch ahead).
SMALL = {
    "validation-not-due": (8, {"val_check_interval": 3}),
    "limited-epoch": (4, {"limit_train_batches": 4}),
    "no-length": (8, {"stream": True}),
}


@pytest.mark.parametrize("case", sorted(SMALL))
def test_a_save_at_an_epochs_last_batch_resumes_exactly(tmp_path, case):
    epoch_end, limits = SMALL[case]
    assert _small_fit(tmp_path / "reference", 12, **limits) == 0
    assert _small_fit(tmp_path / "run", epoch_end, **limits) == 0  # its final checkpoint: the epoch's last batch
    assert _small_fit(tmp_path / "run", 12, **limits) == 0
    same = compare(str(tmp_path / "run"), str(tmp_path / "reference"))
    assert same.exact and same.step == 12 and same.compared > 100, same.line()
