"""``$SPOTGUARD_STOP_ON_ADVISORY=1`` (the AWS terraform module sets it when capacity rebalancing is on)
makes every trainer integration stop on an advisory notice, as ``Guard`` does: an AWS rebalance
recommendation from the mock metadata server (real HTTP, the real ``AwsProvider``) ends training after
the step it arrived in, with an emergency checkpoint of that step and exit code 75, not only an
advisory checkpoint and training on. Each trainer runs in this process, tiny (DeepSpeed as the example,
a group of one); Ray Train's workers use ``Guard`` itself and end their attempt with ``end_attempt``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader

from spotguard import EXIT_PREEMPTED, checkpoint
from spotguard.notices.aws import AwsProvider
from spotguard.storage import open_storage

from ..helpers import after_step, read_losses, subprocess_env, wait_until
from . import runs
from .test_window import FolderLoop

NOTICE_AT = 3  # the rebalance recommendation arrives while this step runs


def reasons(root) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in checkpoint.scan(open_storage(str(root))) if i.complete]


@pytest.fixture
def aws(mock_metadata, monkeypatch):
    """The AWS mock, ``$SPOTGUARD_STOP_ON_ADVISORY=1``, and ``recommend(notices)``: a rebalance
    recommendation that ``notices`` (a ``NoticeWatch``) has seen when it returns."""
    monkeypatch.setenv("SPOTGUARD_STOP_ON_ADVISORY", "1")
    server = mock_metadata("aws")

    def recommend(notices) -> None:
        server.mock.trigger("rebalance")
        wait_until(lambda: notices.due, "the rebalance recommendation never arrived", timeout=10)

    server.recommend = recommend
    return server


def options(server) -> dict:
    return {"providers": [AwsProvider(server.url)], "interval": 0.05, "lease_ttl": None}


@pytest.mark.parametrize("env", ["1", "0"])
def test_a_loop_guard_stops_on_an_advisory_notice_when_the_environment_says_so(tmp_path, aws, monkeypatch, env):
    monkeypatch.setenv("SPOTGUARD_STOP_ON_ADVISORY", env)
    guard = FolderLoop(str(tmp_path), **options(aws))
    with guard:
        for step in range(1, 8):
            if step == NOTICE_AT:
                aws.recommend(guard.notices)
            if guard.step(step):
                break
    if env == "1":
        assert guard.stopped_at == NOTICE_AT and guard.exit_code == EXIT_PREEMPTED
        assert reasons(tmp_path) == [(NOTICE_AT, "emergency")]
    else:  # only an early checkpoint, and training goes on
        assert guard.stopped_at is None and guard.exit_code == 0 and step == 7
        assert reasons(tmp_path) == [(NOTICE_AT, "advisory")]


def test_an_explicit_stop_on_advisory_false_overrides_the_environment(tmp_path, aws):
    guard = FolderLoop(str(tmp_path), **options(aws), stop_on_advisory=False)
    with guard:
        for step in range(1, 6):
            if step == NOTICE_AT:
                aws.recommend(guard.notices)
            assert not guard.step(step)
    assert guard.exit_code == 0 and reasons(tmp_path) == [(NOTICE_AT, "advisory")]


def test_accelerate_stops_on_an_advisory_notice_with_the_environment_set(tmp_path, aws):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from spotguard.integrations.accelerate import AcceleratorGuard

    AcceleratorState._reset_state(True)  # a new run in this process
    try:
        acc = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        guard = AcceleratorGuard(acc, str(tmp_path / "ckpt"), **options(aws))
        stopped = None
        with guard:
            for step in range(1, 8):
                acc.backward(model(torch.randn(4, 2)).sum())
                opt.step()
                opt.zero_grad()
                if step == NOTICE_AT:
                    aws.recommend(guard.notices)
                if guard.step(step):
                    stopped = step
                    break
    finally:
        AcceleratorState._reset_state(True)
    assert stopped == guard.stopped_at == NOTICE_AT and guard.exit_code == EXIT_PREEMPTED
    assert reasons(tmp_path / "ckpt") == [(NOTICE_AT, "emergency")]


def test_the_hf_trainer_stops_on_an_advisory_notice_with_the_environment_set(tmp_path, aws):
    transformers = pytest.importorskip("transformers")
    from spotguard.integrations.hf import SpotguardCallback

    class Recommend(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == NOTICE_AT - 1:  # step NOTICE_AT is under way
                aws.recommend(cb.notices)

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=8,
        per_device_train_batch_size=2,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    cb = SpotguardCallback(str(tmp_path / "ckpt"), **options(aws))
    train = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 16
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=train, callbacks=[Recommend(), cb]
    )
    assert cb.train(trainer) == EXIT_PREEMPTED
    assert cb.stopped_at == trainer.state.global_step == NOTICE_AT
    assert reasons(tmp_path / "ckpt") == [(NOTICE_AT, "emergency")]


def test_lightning_stops_on_an_advisory_notice_with_the_environment_set(tmp_path, aws):
    L = pytest.importorskip("lightning.pytorch")
    from spotguard.integrations.lightning import SpotguardCallback

    cb = SpotguardCallback(str(tmp_path / "ckpt"), **options(aws))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == NOTICE_AT - 1:  # step NOTICE_AT is under way
                aws.recommend(cb.notices)
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(torch.randn(16, 2), batch_size=1)
    assert cb.fit(trainer, Module(), train_dataloaders=loader) == EXIT_PREEMPTED
    assert cb.stopped_at == trainer.global_step == NOTICE_AT
    assert reasons(tmp_path / "ckpt") == [(NOTICE_AT, "emergency")]


def test_a_ray_train_worker_stops_on_an_advisory_notice_and_ends_its_attempt(tmp_path, aws):
    """Ray Train's workers use ``Guard`` (which honoured the variable already) and ``end_attempt``: a
    stop Ray did not announce ends the attempt with ``Preempted`` (Ray restarts the group)."""
    import spotguard
    from spotguard.integrations.ray import Preempted, end_attempt

    model = torch.nn.Linear(2, 1)
    guard = spotguard.Guard(str(tmp_path / "ckpt"), **options(aws)).track(model=model)
    stopped = None
    with guard:
        for step in range(1, 8):
            if step == NOTICE_AT:
                aws.mock.trigger("rebalance")
                wait_until(guard.preempted.is_set, "the rebalance recommendation never stopped the guard", timeout=10)
            if guard.step(step):
                stopped = step
                break
    assert stopped == guard.stopped_at == NOTICE_AT
    assert reasons(tmp_path / "ckpt") == [(NOTICE_AT, "emergency")]
    with pytest.raises(Preempted, match=f"stopped at step {NOTICE_AT} for a notice Ray did not announce"):
        end_attempt(guard)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_stops_on_an_advisory_notice_with_the_environment_set(tmp_path, mock_metadata):
    """The example as a group of one (plain ``python``: a real engine needs a process group)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed: pip install 'spotguard[deepspeed]'")
    from spotguard.ops.mockmeta import endpoint_env

    server = mock_metadata("aws")
    env = subprocess_env(SPOTGUARD_STOP_ON_ADVISORY="1", **endpoint_env("aws", server.url))
    args = ("--steps", "60", "--every-steps", "0", "--zero-stage", "0", "--providers", "aws", "--interval", "0.1")
    proc = runs.stop_when(
        "deepspeed_train.py",
        tmp_path,
        (*args, *runs.SLOW),
        after_step(tmp_path / "losses.jsonl", 4),
        lambda proc: server.mock.trigger("rebalance"),
        env=env,
    )
    stopped = runs.assert_stopped(proc, tmp_path)
    assert 4 <= stopped < 60 and read_losses(tmp_path / "losses.jsonl")[-1][0] == stopped
    assert reasons(tmp_path / "ckpt") == [(stopped, "emergency")]
