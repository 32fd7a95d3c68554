"""The heartbeat's marks of a save and of an evaluation, set by the trainer integrations in one process
(``heartbeat.Activity``, held by slot): what ``spotguard rehearse --during-save/--during-eval`` waits for. Each trainer's
own save and evaluation read the marks while they run; both are cleared once they end. (The HF
Trainer's and DeepSpeed's are also rehearsed end to end in tests/ops/test_rehearse.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch.utils.data import DataLoader

from spotguard import heartbeat
from spotguard.heartbeat import EVALUATING, SAVING


@pytest.fixture
def slots(tmp_path, monkeypatch) -> memoryview:
    """The heartbeat the job is given, as the fleet reads it (another mapping of the same file)."""
    beat = heartbeat.create(tmp_path / "beat")
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(beat))
    return heartbeat.attach(str(beat))


class Peek:
    """Registered for checkpointing: its ``state_dict()`` runs inside a save and reads the marks."""

    def __init__(self, slots: memoryview) -> None:
        self.slots = slots
        self.seen: list[tuple[int, int]] = []

    def state_dict(self) -> dict:
        self.seen.append((self.slots[SAVING], self.slots[EVALUATING]))
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_mark_begun_in_one_hook_is_cleared_in_another_and_a_block_keeps_an_earlier_start(slots):
    marks = heartbeat.Activity(slots)
    marks.hold(SAVING, 4)  # e.g. the Trainer begins writing its folder
    marks.hold(SAVING, 9)  # a later hook of the same save: the earlier start stands
    with marks.during(SAVING, 9):
        assert slots[SAVING] == 5
    assert slots[SAVING] == 5  # a block inside the save leaves it marked
    with marks.during(SAVING, 4, last=True):  # the commit: the save's last part
        assert slots[SAVING] == 5
    assert slots[SAVING] == 0
    marks.release(SAVING)  # nothing held: nothing happens
    with pytest.raises(RuntimeError), marks.during(EVALUATING, 0):
        assert slots[EVALUATING] == 1
        raise RuntimeError
    assert slots[EVALUATING] == 0


def test_accelerator_guard_marks_its_saves_and_evaluations(tmp_path, slots):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from spotguard.integrations.accelerate import AcceleratorGuard

    AcceleratorState._reset_state(True)  # a new run in this process
    try:
        acc = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        peek = Peek(slots)
        guard = AcceleratorGuard(acc, str(tmp_path / "ckpt"), every_steps=2, providers=[], lease_ttl=None)
        guard.track(peek)
        during_evaluations = []
        with guard:
            for step in range(1, 5):
                assert not guard.step(step)
                with guard.evaluation():
                    during_evaluations.append((slots[SAVING], slots[EVALUATING]))
                assert slots[SAVING] == slots[EVALUATING] == 0
    finally:
        AcceleratorState._reset_state(True)
    assert peek.seen == [(3, 0), (5, 0)]  # 1 + the step, while save_state runs
    assert during_evaluations == [(0, 2), (0, 3), (0, 4), (0, 5)]


def lightning_run(slots: memoryview, notice_in_validation: bool = False):
    """A tiny Lightning module that notes the marks in each validation batch and inside each save
    (``on_save_checkpoint``), and a Trainer validating every 2 steps; optionally a SIGUSR1 (a notice)
    in the first validation batch of training, which cuts that validation short."""
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen: list[tuple[str, int, int, int]] = []
            self.notice: threading.Event | None = None

        def _look(self, what: str) -> None:
            self.seen.append((what, self.trainer.global_step, slots[SAVING], slots[EVALUATING]))

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def validation_step(self, batch, batch_idx):
            self._look("sanity" if self.trainer.sanity_checking else "validation")
            if notice_in_validation and not self.trainer.sanity_checking and self.notice is not None:
                os.kill(os.getpid(), signal.SIGUSR1)
                assert self.notice.wait(10)

        def on_save_checkpoint(self, checkpoint) -> None:
            self._look("save")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        max_steps=4,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer, Module()


def test_lightning_callback_marks_its_saves_and_validations(tmp_path, slots):
    from spotguard.integrations.lightning import SpotguardCallback

    trainer, module = lightning_run(slots)
    cb = SpotguardCallback(str(tmp_path / "ckpt"), every_steps=2, providers=[], lease_ttl=None)
    loader = DataLoader(torch.randn(8, 2), batch_size=1)
    assert cb.fit(trainer, module, train_dataloaders=loader, val_dataloaders=DataLoader(torch.randn(2, 2))) == 0
    # saved at the batch's end, then validated; the sanity check before training is no evaluation
    assert module.seen == [
        ("sanity", 0, 0, 0),
        ("save", 2, 3, 0),
        ("validation", 2, 0, 3),
        ("validation", 2, 0, 3),
        ("save", 4, 5, 0),
        ("validation", 4, 0, 5),
        ("validation", 4, 0, 5),
    ]
    assert slots[SAVING] == slots[EVALUATING] == 0


def test_a_validation_cut_short_by_a_notice_is_no_longer_marked_during_the_emergency_save(tmp_path, slots):
    from spotguard import EXIT_PREEMPTED
    from spotguard.integrations.lightning import SpotguardCallback

    trainer, module = lightning_run(slots, notice_in_validation=True)
    cb = SpotguardCallback(str(tmp_path / "ckpt"), providers=["signal"], interval=0.05, lease_ttl=None)
    module.notice = cb.notices.preempted
    loader = DataLoader(torch.randn(8, 2), batch_size=1)
    code = cb.fit(trainer, module, train_dataloaders=loader, val_dataloaders=DataLoader(torch.randn(2, 2)))
    assert code == EXIT_PREEMPTED and cb.stopped_at == 2
    # left after its first batch; the emergency checkpoint of step 2 is a save, not an evaluation
    assert module.seen == [("sanity", 0, 0, 0), ("validation", 2, 0, 3), ("save", 2, 3, 0)]
    assert slots[SAVING] == slots[EVALUATING] == 0


class Looked(torch.utils.data.Dataset):
    """Evaluation data whose items note the marks as the Trainer's evaluation loop fetches them."""

    def __init__(self, slots: memoryview) -> None:
        self.slots = slots
        self.seen: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.seen.append((self.slots[SAVING], self.slots[EVALUATING]))
        ids = torch.arange(8) % 16
        return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("via_train", [True, False], ids=["cb.train", "bare-callback"])
def test_hf_callback_marks_the_trainers_saves_and_evaluations(tmp_path, slots, via_train):
    transformers = pytest.importorskip("transformers")

    from spotguard.integrations.hf import SpotguardCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,  # three batches per evaluation
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    evaluation = Looked(slots)
    cb = SpotguardCallback(str(tmp_path / "ckpt"), providers=[], lease_ttl=None)
    commit, committing = cb.checkpoints.commit, []

    def looked_commit(step, *a, **kw):
        committing.append((step, slots[SAVING], slots[EVALUATING]))
        return commit(step, *a, **kw)

    cb.checkpoints.commit = looked_commit  # type: ignore[method-assign]
    train = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 4
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        callbacks=[cb],
    )
    if via_train:
        assert cb.train(trainer) == 0
        assert evaluation.seen == [(0, 3)] * 6  # the whole evaluation of step 2
    else:
        trainer.train()  # the callback sees the evaluation from its first prediction step on
        marked = [looked == (0, 3) for looked in evaluation.seen]  # (the loader fetches a batch ahead)
        assert marked[:2] == [False, False] and marked[-2:] == [True, True], evaluation.seen
        assert set(evaluation.seen) == {(0, 0), (0, 3)}
    assert committing == [(2, 3, 0)]  # the Trainer's folder of step 2, committed while marked
    assert slots[SAVING] == slots[EVALUATING] == 0
