"""Every trainer integration refuses a resume that would drop saved state nothing restores now, naming it
(``untracked="accept"``: resumed without it, with a warning), as ``Guard`` does (tests/guard/test_untracked.py).
Each trainer runs here in this process, tiny: Accelerate (an optimizer and scheduler no longer prepared),
Lightning (a scheduler no longer configured: it zips the saved list with the configured one), the HF
Trainer (a stateful callback it would not restore). DeepSpeed's case (an engine without the saved
optimizer) runs in tests/integrations/test_deepspeed.py's torchrun launch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from spotguard import EXIT_CONFIG, heartbeat
from spotguard.errors import CheckpointMismatchError
from spotguard.storage import Storage


@pytest.fixture
def beat(tmp_path, monkeypatch) -> memoryview:
    """The heartbeat `spotguard run` gives the job: a refusal marks it (exit 78, no restart)."""
    path = heartbeat.create(tmp_path / "beat")
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(path))
    return heartbeat.attach(str(path))


def test_accelerator_guard_refuses_a_checkpoint_of_an_optimizer_no_longer_prepared(tmp_path, accelerator, beat):
    from spotguard.integrations.accelerate import AcceleratorGuard

    acc, _ = accelerator(with_optimizer=True)
    AcceleratorGuard(acc, str(tmp_path), providers=[], lease_ttl=None).save(3)
    acc, _ = accelerator(with_optimizer=False)
    guard = AcceleratorGuard(acc, str(tmp_path), providers=[], lease_ttl=None)
    with pytest.raises(
        CheckpointMismatchError, match=r"step 3 holds the state of optimizer, scheduler, which nothing tracks now"
    ):
        guard.resume()
    assert beat[1] & heartbeat.CONFIG_ERROR
    acc, _ = accelerator(with_optimizer=False)
    accepting = AcceleratorGuard(acc, str(tmp_path), providers=[], lease_ttl=None, untracked="accept")
    assert accepting.resume() == 3


def quiet_trainer(max_steps: int, **kw):
    """A Lightning ``Trainer`` on the CPU that logs, shows and saves nothing of its own."""
    L = pytest.importorskip("lightning.pytorch")
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def lightning_fit(storage, *, scheduler: bool, max_steps: int, **options) -> tuple[int, object]:
    """A tiny Lightning fit through ``cb.fit`` (a periodic checkpoint every 2 steps): (exit code, callback)."""
    L = pytest.importorskip("lightning.pytorch")
    from spotguard.integrations.lightning import SpotguardCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return ([opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]) if scheduler else opt

    trainer = quiet_trainer(max_steps)
    cb = SpotguardCallback(
        storage if isinstance(storage, Storage) else str(storage),
        every_steps=2,
        providers=[],
        lease_ttl=None,
        **options,
    )
    return cb.fit(trainer, Module(), train_dataloaders=DataLoader(torch.randn(8, 2), batch_size=1)), cb


def test_lightning_refuses_a_checkpoint_of_a_scheduler_no_longer_configured(tmp_path, beat, caplog):
    assert lightning_fit(tmp_path, scheduler=True, max_steps=2)[0] == 0
    with caplog.at_level(logging.ERROR, logger="spotguard"):
        code, cb = lightning_fit(tmp_path, scheduler=False, max_steps=4)
    assert code == EXIT_CONFIG
    assert "checkpoint of step 2 holds the state of lr_scheduler, which nothing tracks now" in caplog.text
    assert "configure_optimizers" in caplog.text and "untracked='accept'" in caplog.text
    assert beat[1] & heartbeat.CONFIG_ERROR
    code, cb = lightning_fit(tmp_path, scheduler=False, max_steps=4, untracked="accept")
    assert code == 0 and cb.checkpoints.last_saved.step == 4


def hf_train(
    storage, out, *, callbacks: list, max_steps: int, restore: bool = False, seed: int = 0, plain=(), **options
) -> int:
    """A tiny HF Trainer run through ``cb.train`` (a checkpoint every 2 steps); its exit code. ``plain``:
    callbacks that run before spotguard's, and a plain ``trainer.train()`` from step 0 (no resume)."""
    transformers = pytest.importorskip("transformers")
    from spotguard.integrations.hf import SpotguardCallback

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        restore_callback_states_from_checkpoint=restore,
    )
    cb = SpotguardCallback(str(storage), providers=[], lease_ttl=None, **options)
    train = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 8
    model = transformers.GPT2LMHeadModel(config)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[*plain, cb, *callbacks])
    if not plain:
        return cb.train(trainer)
    try:
        trainer.train()
    finally:
        cb.close()
    return cb.exit_code


def counter():
    """A stateful Trainer callback (as ``EarlyStoppingCallback``): its state is saved in trainer_state.json."""
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_callback import ExportableState

    class Counter(transformers.TrainerCallback, ExportableState):
        def __init__(self, steps: int = 0) -> None:
            self.steps = steps

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

        def state(self) -> dict:
            return {"args": {"steps": self.steps}, "attributes": {}}

    return Counter()


def test_hf_refuses_a_checkpoint_of_a_callback_state_the_trainer_would_not_restore(tmp_path, beat, caplog):
    storage, out = tmp_path / "ckpt", tmp_path / "out"
    assert hf_train(storage, out, callbacks=[counter()], max_steps=2) == 0
    with caplog.at_level(logging.ERROR, logger="spotguard"):
        assert hf_train(storage, out, callbacks=[counter()], max_steps=4) == EXIT_CONFIG
    assert "checkpoint of step 2 holds the state of Counter, which nothing tracks now" in caplog.text
    assert "restore_callback_states_from_checkpoint=True" in caplog.text
    assert beat[1] & heartbeat.CONFIG_ERROR
    assert hf_train(storage, out, callbacks=[counter()], max_steps=4, restore=True) == 0  # restored: resumed
    assert hf_train(storage, out, callbacks=[], max_steps=6, untracked="accept") == 0
