"""Forward compatibility: a checkpoint of a newer spotguard's manifest format is never taken for corrupt.

Resume refuses to fall back past it (that would lose the work since) and says to upgrade; pruning
leaves it alone; a truly corrupt newest checkpoint is still skipped for the previous one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.format.manifest import Manifest
from spotguard.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointMismatchError
from spotguard.storage import open_storage

UPGRADE = "pip install -U spotguard"


def as_newer_format(step_dir: Path, fmt: str = "spotguard/99", version: str | None = "9.9.0") -> None:
    """Rewrite a real checkpoint's manifest as a future spotguard might write it: another format, and
    (to show that nothing else is read) a files list this version would call invalid."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["format"] = fmt
    manifest["files"] = {"chunks": "a future layout"}
    if version is None:
        del manifest["spotguard_version"]
    else:
        manifest["spotguard_version"] = version
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def make_guard(root: Path, value: float, **kw) -> tuple[spotguard.Guard, torch.nn.Linear]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return spotguard.Guard(str(root), providers=[], **kw).track(model=model), model


def save_steps(root: Path, *steps: int) -> None:
    for step in steps:
        guard, _ = make_guard(root, float(step), keep=10)
        guard.save(step, "periodic")


def test_a_newer_format_is_its_own_error_naming_the_format_the_writer_and_the_upgrade(tmp_path):
    save_steps(tmp_path, 1)
    step_dir = tmp_path / "step-00000001"
    as_newer_format(step_dir)
    with pytest.raises(CheckpointFormatError) as e:
        Manifest.from_bytes((step_dir / "manifest.json").read_bytes(), where="step-00000001")
    assert not isinstance(e.value, CheckpointCorruptError)  # resume loops skip those
    assert isinstance(e.value, CheckpointMismatchError) and isinstance(e.value, ValueError)
    text = str(e.value)
    assert "step-00000001" in text and "spotguard/99" in text and "spotguard 9.9.0" in text and UPGRADE in text
    assert f"spotguard {spotguard.__version__} cannot read" in text
    as_newer_format(step_dir, "spotguard/4", version=None)
    with pytest.raises(CheckpointFormatError, match=r"written by a newer spotguard in manifest format spotguard/4"):
        Manifest.from_bytes((step_dir / "manifest.json").read_bytes())
    as_newer_format(step_dir, version="9.9\n[forged log line]")  # never echoed as it is
    with pytest.raises(CheckpointFormatError, match="written by a newer spotguard") as e:
        Manifest.from_bytes((step_dir / "manifest.json").read_bytes())
    assert "forged" not in str(e.value)


@pytest.mark.parametrize("fmt", ["spotguard/0", "spotguard/2.1", "spotguard/-3", "acme/3", "SPOTGUARD/3", 3, None])
def test_other_unknown_formats_stay_corrupt(tmp_path, fmt):
    save_steps(tmp_path, 1)
    as_newer_format(tmp_path / "step-00000001", fmt)
    (info,) = checkpoint.scan(open_storage(str(tmp_path)))
    assert info.status == "corrupt" and "invalid manifest" in info.problem


def test_scan_and_latest_report_a_newer_format_and_latest_refuses_to_go_past_it(tmp_path):
    save_steps(tmp_path, 1, 2)
    storage = open_storage(str(tmp_path))
    as_newer_format(tmp_path / "step-00000002")
    old, new = checkpoint.scan(storage)
    assert old.status == "complete" and (new.step, new.status, new.manifest) == (2, "newer-format", None)
    assert not new.complete and "spotguard/99" in new.problem and UPGRADE in new.problem
    with pytest.raises(
        CheckpointFormatError, match=r"the newest checkpoint step-00000002 was written by spotguard 9\.9\.0"
    ):
        checkpoint.latest(storage)
    # Files of a newer format cannot be checked nor copied here: the error says why, not "corrupt".
    for use in (
        lambda: checkpoint.verify(storage, new),
        lambda: checkpoint.copy(storage, open_storage(str(tmp_path / "copy")), new),
        lambda: checkpoint.fetch(storage, new, tmp_path / "fetched"),
    ):
        with pytest.raises(CheckpointFormatError, match="spotguard/99"):
            use()
    # A newer spotguard's checkpoint older than the newest complete one hides nothing: latest is that one.
    save_steps(tmp_path, 3)
    assert checkpoint.latest(storage).step == 3


def test_resume_refuses_to_fall_back_past_a_newer_format_and_says_to_upgrade(tmp_path, caplog):
    save_steps(tmp_path, 1, 2)
    as_newer_format(tmp_path / "step-00000002")
    guard, model = make_guard(tmp_path, 0.0)
    with pytest.raises(
        CheckpointFormatError,
        match=r"step-00000002 was written by spotguard 9\.9\.0 in manifest format spotguard/99.*pip install -U spotguard",
    ):
        guard.resume()
    assert torch.all(model.weight == 0.0)  # step 1 was not loaded in its place
    # Only a newer format below the newest complete checkpoint: that one resumes.
    save_steps(tmp_path, 3)
    guard, model = make_guard(tmp_path, 0.0)
    assert guard.resume() == 3 and torch.all(model.weight == 3.0)
    # A corrupt newest checkpoint keeps today's behaviour: a warning, the previous one resumes...
    save_steps(tmp_path, 4)
    (tmp_path / "step-00000004" / "manifest.json").write_text("{not json")
    guard, model = make_guard(tmp_path, 0.0)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert guard.resume() == 3 and torch.all(model.weight == 3.0)
    assert "step-00000004" in caplog.text and "invalid manifest" in caplog.text
    # ...but never one past a newer format: a corrupt newest, then a newer format, then a good one.
    as_newer_format(tmp_path / "step-00000003")
    guard, model = make_guard(tmp_path, 0.0)
    with pytest.raises(CheckpointFormatError, match="step-00000003"):
        guard.resume()
    assert torch.all(model.weight == 0.0)


def test_a_newer_format_only_in_the_local_tier_is_refused_too(tmp_path):
    durable, local = tmp_path / "bucket", tmp_path / "nvme"
    save_steps(durable, 1)
    save_steps(local, 2)
    as_newer_format(local / "step-00000002")
    guard, model = make_guard(durable, 0.0, local_dir=str(local))
    with pytest.raises(CheckpointFormatError, match=r"nvme.*step-00000002.*spotguard/99"):
        guard.resume()
    assert torch.all(model.weight == 0.0)


def test_a_newer_format_alone_is_refused_not_a_fresh_start(tmp_path):
    save_steps(tmp_path, 5)
    as_newer_format(tmp_path / "step-00000005")
    guard, _ = make_guard(tmp_path, 0.0)
    with pytest.raises(CheckpointFormatError):
        guard.resume()


def test_pruning_keeps_newer_format_checkpoints_and_does_not_count_them(tmp_path):
    save_steps(tmp_path, 1, 2, 3, 4, 5)
    for step in (1, 4):
        as_newer_format(tmp_path / checkpoint.step_dir(step))
    storage = open_storage(str(tmp_path))
    assert checkpoint.prune(storage, keep=2) == [2]  # keep 3 and 5, the two newest this version reads
    assert {i.step: i.status for i in checkpoint.scan(storage)} == {
        1: "newer-format",
        3: "complete",
        4: "newer-format",
        5: "complete",
    }
    assert checkpoint.prune(storage, keep=1) == [3]
    assert [i.step for i in checkpoint.scan(storage)] == [1, 4, 5]
    checkpoint.delete(storage, "step-00000004")  # what `spotguard rm --step 4` does
    assert [i.step for i in checkpoint.scan(storage)] == [1, 5]


def test_a_final_save_never_replaces_a_newer_format_checkpoint_of_its_step(tmp_path):
    save_steps(tmp_path, 6)
    as_newer_format(tmp_path / "step-00000006")
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-00000006").iterdir()}
    storage = open_storage(str(tmp_path))
    with pytest.raises(CheckpointFormatError, match=UPGRADE):
        checkpoint.write(storage, 6, {"state.pt": lambda f: f.write(b"other state")}, reason="final", replace=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-00000006").iterdir()} == before


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_resume_refuses_to_fall_back_past_a_newer_format(tmp_path, group, caplog):
    save_steps(tmp_path, 1, 2)
    newest = checkpoint.latest(open_storage(str(tmp_path)))
    assert "shards/metadata.dcp" in {f.name for f in newest.manifest.files}  # the sharded engine wrote it
    as_newer_format(tmp_path / "step-00000002")
    guard, model = make_guard(tmp_path, 0.0)
    with pytest.raises(
        CheckpointFormatError, match=r"step-00000002 was written by spotguard 9\.9\.0.*pip install -U spotguard"
    ):
        guard.resume()
    assert torch.all(model.weight == 0.0)
    # A corrupt newest one is still skipped (logged) for the previous one.
    save_steps(tmp_path, 3)
    (tmp_path / "step-00000003" / "manifest.json").write_text("[]")
    as_newer_format(tmp_path / "step-00000002", "acme/2")
    guard, model = make_guard(tmp_path, 0.0)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert guard.resume() == 1 and torch.all(model.weight == 1.0)
    assert "step-00000003" in caplog.text and "step-00000002" in caplog.text


def test_a_final_save_keeps_a_newer_format_local_copy_of_its_step(tmp_path):
    durable, local = tmp_path / "bucket", tmp_path / "nvme"
    save_steps(local, 2)
    as_newer_format(local / "step-00000002")
    before = (local / "step-00000002" / "manifest.json").read_bytes()
    guard, _ = make_guard(durable, 0.0, local_dir=str(local), every_steps=2, busy="wait")
    with guard:
        guard.step(1)
        guard.step(2)
    assert [(i.step, i.status) for i in checkpoint.scan(open_storage(str(durable)))] == [(2, "complete")]
    assert (local / "step-00000002" / "manifest.json").read_bytes() == before
