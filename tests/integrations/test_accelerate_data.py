"""AcceleratorGuard in one process: it warns about a prepared loader whose position cannot be saved, as
Guard.track() does, and resumes an evaluation a notice cut short exactly (``guard.evaluation()``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from spotguard import EXIT_PREEMPTED  # noqa: E402
from spotguard.checkpoint import scan  # noqa: E402
from spotguard.integrations.accelerate import AcceleratorGuard  # noqa: E402
from spotguard.notices.file import FileProvider  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402


@pytest.fixture
def accelerator():
    made = []

    def make(stateful: bool):
        AcceleratorState._reset_state(True)  # a new run in this process
        acc = accelerate.Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful)
        )
        made.append(acc)
        return acc

    yield make
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("given", [DataLoader, StatefulDataLoader])
def test_a_loader_prepared_without_state_gets_the_guards_warning(tmp_path, accelerator, given):
    acc = accelerator(stateful=False)
    acc.prepare(torch.nn.Linear(2, 2), given(list(range(8)), batch_size=2))  # a plain DataLoader either way
    guard = AcceleratorGuard(acc, str(tmp_path), providers=[])
    with pytest.warns(
        UserWarning, match=r"'prepared loader 0' is a plain torch DataLoader.*use_stateful_dataloader=True"
    ):
        assert guard.resume() == 0


def test_a_stateful_prepared_loader_gets_no_warning(tmp_path, accelerator):
    acc = accelerator(stateful=True)
    acc.prepare(torch.nn.Linear(2, 2), DataLoader(list(range(8)), batch_size=2))
    guard = AcceleratorGuard(acc, str(tmp_path), providers=[])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert guard.resume() == 0
    assert not [w for w in seen if "plain torch DataLoader" in str(w.message)]


class Epochs:
    """The loop's epoch counter, saved with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


def epoch_loop(
    acc, storage, notice: Path | None = None, every_steps: int | None = None
) -> tuple[list[tuple], int, dict]:
    """3 epochs of 6 batches, each followed by an evaluation that draws (dropout on, noisy inputs); with
    ``notice``, that file appears at the second batch of epoch 1's evaluation. Returns every logged row,
    the exit code and the final weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(4), torch.randn(1)) for _ in range(24)]
    model, opt, loader = acc.prepare(model, opt, StatefulDataLoader(data, batch_size=4, shuffle=True))
    providers = [FileProvider(notice)] if notice else []
    guard = AcceleratorGuard(acc, str(storage), providers=providers, interval=0.02, every_steps=every_steps)
    epochs = Epochs()
    guard.track(epochs)
    step, rows = guard.resume(), []
    with guard:
        while epochs.epoch < 3:
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                acc.backward(loss)
                opt.step()
                step += 1
                rows.append(("train", step, loss.item()))
                if guard.step(step):
                    return rows, guard.exit_code, {}
            with guard.evaluation() as ev, torch.no_grad():  # dropout stays on: the draws matter
                for i in range(4):
                    if notice and epochs.epoch == 1 and i == 1:
                        notice.write_text('{"deadline_in": 60}')
                        assert guard.notices.preempted.wait(10)
                    if ev.should_stop():
                        break
                    rows.append(("eval", epochs.epoch, model(data[i][0] + 0.1 * torch.randn(4)).item()))
            if guard.step(step):
                return rows, guard.exit_code, {}
            epochs.epoch += 1
    return rows, guard.exit_code, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("every_steps", [None, 6], ids=["no-periodic", "periodic-before-evaluation"])
def test_a_notice_in_an_epochs_closing_evaluation_resumes_it_from_its_start_exactly(tmp_path, accelerator, every_steps):
    """The evaluation after an epoch's last batch (the loader has ended its epoch): the checkpoint holds
    the loader as at its last batch and the streams as the evaluation found them, so the resumed loop's
    first pass is empty, it evaluates again with the same draws, then trains on as the reference.

    With ``every_steps=6`` the periodic checkpoint of step 12 is committed before that evaluation, with the
    loader as after its epoch and no cut: the stop commits the cut state of step 12 in its place."""
    ref, code, ref_weights = epoch_loop(accelerator(stateful=True), tmp_path / "ref", every_steps=every_steps)
    assert code == 0
    cut, code, _ = epoch_loop(accelerator(stateful=True), tmp_path / "run", tmp_path / "notice", every_steps)
    assert code == EXIT_PREEMPTED
    assert cut == ref[: len(cut)] and cut[-1][:2] == ("eval", 1)  # cut at its second batch
    *superseded, info = [i for i in scan(open_storage(str(tmp_path / "run"))) if i.step == 12]  # highest last
    assert info.complete and info.manifest is not None and info.manifest.reason == "emergency", info
    assert info.revision == (1 if every_steps else 0)  # written beside the periodic one...
    assert [i.revision for i in superseded] == ([0] if every_steps else [])  # ...pruned by the next save
    (tmp_path / "notice").unlink()
    resumed, code, weights = epoch_loop(accelerator(stateful=True), tmp_path / "run", every_steps=every_steps)
    assert code == 0
    begun = ref.index(cut[-1])
    assert resumed == ref[begun:]
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
