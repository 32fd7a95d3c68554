"""What the trainer integrations share: trainer folders committed and found again, the notice flag,
and the promise that spotguard never imports a trainer unless asked to."""

from __future__ import annotations

import datetime as dt
import logging
import subprocess
import sys

import pytest

from spotguard import EXIT_PREEMPTED, checkpoint
from spotguard.errors import CheckpointFormatError, ConfigError, NoLoadableCheckpointError
from spotguard.integrations._common import NoticeWatch
from spotguard.integrations._folders import FolderCheckpoints
from spotguard.notices.base import Notice

from ..helpers import subprocess_env


def trainer_folder(root, step: int):
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return folder


def test_newest_verified_skips_a_folder_cut_short_and_one_that_fails_its_checksums(tmp_path, caplog):
    ckpts = FolderCheckpoints(str(tmp_path / "ckpt"), keep=5, work_dir=str(tmp_path / "work"))
    for step in (10, 20, 30):
        assert ckpts.commit(step, trainer_folder(tmp_path / "out", step), "periodic") is not None
    # step 30: a file replaced after the commit (same size); step 40: files but no manifest (a kill mid-save)
    stored = tmp_path / "ckpt" / "step-00000030" / "model.safetensors"
    stored.unlink()
    stored.write_bytes(b"\xff" * 64)
    (tmp_path / "ckpt" / "step-00000040").mkdir()
    (tmp_path / "ckpt" / "step-00000040" / "model.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING):
        step, folder = ckpts.newest_verified()
    assert step == 20
    assert (folder / "model.safetensors").read_bytes() == bytes([20]) * 64
    assert (folder / "trainer_state.json").read_text() == '{"global_step": 20}'
    assert "step-00000040: incomplete" in caplog.text and "checksum does not match the manifest" in caplog.text
    ckpts.cleanup()
    assert not folder.exists() and (tmp_path / "ckpt" / "step-00000020").is_dir()


def test_newest_verified_refuses_a_newer_spotguard_format_instead_of_an_older_folder(tmp_path):
    ckpts = FolderCheckpoints(str(tmp_path / "ckpt"), keep=5, work_dir=str(tmp_path / "work"))
    for step in (10, 20):
        ckpts.commit(step, trainer_folder(tmp_path / "out", step), "periodic")
    path = tmp_path / "ckpt" / "step-00000020" / "manifest.json"
    path.write_text(path.read_text().replace('"spotguard/3"', '"spotguard/99"'))
    with pytest.raises(CheckpointFormatError, match=r"step-00000020 .*spotguard/99.*pip install -U spotguard"):
        ckpts.newest_verified()
    assert not (tmp_path / "work").exists()  # step 10 was not fetched


def test_newest_verified_raises_when_checkpoints_exist_but_none_loads_unless_fresh_is_asked(tmp_path, caplog):
    ckpts = FolderCheckpoints(str(tmp_path / "ckpt"), keep=5, work_dir=str(tmp_path / "work"))
    for step in (10, 20):
        ckpts.commit(step, trainer_folder(tmp_path / "out", step), "periodic")
        stored = tmp_path / "ckpt" / f"step-{step:08d}" / "model.safetensors"
        stored.unlink()
        stored.write_bytes(b"\xff" * 64)  # both fail their checksums
    (tmp_path / "ckpt" / "step-00000030").mkdir()  # and a save cut short, which counts for nothing
    with pytest.raises(NoLoadableCheckpointError, match=r"2 checkpoint\(s\) and none of them loads") as e:
        ckpts.newest_verified()
    assert [s.split(":")[0].rsplit("/", 1)[-1] for s in e.value.skipped] == ["step-00000020", "step-00000010"]
    ckpts.fresh_ok = True  # on_unloadable="fresh"
    with caplog.at_level(logging.WARNING):
        assert ckpts.newest_verified() is None
    assert "no checkpoint that loads" in caplog.text


def test_commit_prunes_to_keep_and_a_committed_step_is_not_written_twice(tmp_path):
    ckpts = FolderCheckpoints(str(tmp_path / "ckpt"), keep=2)
    for step in (1, 2, 3):
        ckpts.commit(step, trainer_folder(tmp_path / "out", step), "periodic")
    assert [i.step for i in checkpoint.scan(ckpts.storage)] == [2, 3]
    assert ckpts.commit(3, tmp_path / "out" / "checkpoint-3", "emergency") is None
    assert checkpoint.latest(ckpts.storage).manifest.reason == "periodic"


def test_an_emergency_commit_leaves_pruning_to_the_next_commit(tmp_path):
    """A trainer's emergency save: nothing of ours but the commit on the deadline's clock."""
    ckpts = FolderCheckpoints(str(tmp_path / "ckpt"), keep=1)
    ckpts.commit(1, trainer_folder(tmp_path / "out", 1), "periodic")
    ckpts.commit(2, trainer_folder(tmp_path / "out", 2), "emergency")
    assert [i.step for i in checkpoint.scan(ckpts.storage)] == [1, 2]
    ckpts.commit(3, trainer_folder(tmp_path / "out", 3), "periodic")
    assert [i.step for i in checkpoint.scan(ckpts.storage)] == [3]


def test_storage_comes_from_the_environment_or_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SPOTGUARD_STORAGE", raising=False)
    with pytest.raises(ConfigError, match="SPOTGUARD_STORAGE"):
        FolderCheckpoints(None)
    monkeypatch.setenv("SPOTGUARD_STORAGE", str(tmp_path / "env"))
    assert FolderCheckpoints(None).storage.describe() == str(tmp_path / "env")


def test_notice_watch_flags_stop_and_advisory_notices():
    watch = NoticeWatch(providers=[])
    assert not watch.due and watch.exit_code == 0 and watch.deadline() is None
    watch.watcher.report(Notice("aws", "rebalance", raw={"id": 1}))
    assert watch.due and not watch.preempted.is_set()
    assert watch.take_advisory() and not watch.due and not watch.take_advisory()
    deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120)
    watch.watcher.report(Notice("aws", "terminate", deadline=deadline, raw={"id": 2}))
    assert watch.due and watch.preempted.is_set() and watch.exit_code == EXIT_PREEMPTED
    assert not watch.take_advisory() and watch.due  # a stop stays due
    import time

    assert 100 < watch.deadline() - time.monotonic() <= 120


def test_notice_watch_beats_the_step_and_marks_a_stop_for_spotguard_run(tmp_path, monkeypatch):
    from spotguard import heartbeat

    path = heartbeat.create(tmp_path / "beat")
    monkeypatch.setenv(heartbeat.HEARTBEAT_ENV, str(path))
    watch = NoticeWatch(providers=[])
    assert watch.check(7) == 0 and heartbeat.read(path) == (7, 0)  # the hang watchdog sees step 7
    watch.preempted.set()  # a stop notice, as the watcher reports one: preempted first, then the callback
    watch._on_notice(Notice("signal", "signal"))
    assert watch.check(8) != 0 and heartbeat.read(path) == (8, heartbeat.STOPPED_FOR_NOTICE)


def test_a_stop_before_any_training_says_no_checkpoint_is_needed_not_already_checkpointed(caplog):
    """A notice in HF's evaluation at start or Lightning's sanity check, on a fresh run: step 0 is the resume
    point, so nothing is written; the log said "already checkpointed" where the storage held nothing."""
    watch = NoticeWatch(providers=[])
    watch.emergency(0, True, lambda deadline: None, None, None, may_train_on=False)
    assert "stop at step 0: nothing trained yet, no checkpoint needed" in caplog.text
    assert "already checkpointed" not in caplog.text
    watch.emergency(8, True, lambda deadline: None, 1.0, 8, may_train_on=False)
    assert "stop at step 8: already checkpointed" in caplog.text


def test_spotguard_never_imports_a_trainer_and_names_the_extra_when_one_is_missing():
    code = (
        "import sys, spotguard, spotguard.integrations, spotguard.integrations.accelerate\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))\n"
        "sys.modules['transformers'] = None; sys.modules['lightning'] = None\n"
        "for name in ('hf', 'lightning'):\n"
        "    try:\n"
        "        __import__('spotguard.integrations.' + name)\n"
        "    except ImportError as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[]"
    assert "MissingDependencyError" in lines[1] and "pip install 'spotguard[hf]'" in lines[1]
    assert "MissingDependencyError" in lines[2] and "pip install 'spotguard[lightning]'" in lines[2]


def test_a_loop_guard_saves_on_multiples_of_every_steps_after_a_resume_between_them(tmp_path):
    """Accelerate's and DeepSpeed's guards share this schedule: resumed at 7, they save at 10 and 20."""
    from spotguard.integrations._loop import LoopGuard

    class Recording(LoopGuard):
        saved: list[int] = []

        def save(self, step, reason="manual", *, deadline=None):
            self.saved.append(step)
            self._saved(step)
            return None

        def resume(self):
            self._resumed(7)
            return 7

    guard = Recording(str(tmp_path / "ckpt"), {"every_steps": 10, "save_on_exit": False, "providers": []})
    with guard:
        for step in range(guard.resume() + 1, 24):
            guard.step(step)
    assert guard.saved == [10, 20]


def test_the_resume_checks_a_loaders_batch_size_marks_a_refusal_and_takes_the_rebatch_option(tmp_path, caplog):
    """``FolderCheckpoints.check_loaders``: the Guard's check (``data.check_loaders``) with the integration's option;
    a refusal marks the heartbeat, so that ``spotguard run`` exits 78 instead of restarting into it."""
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    from spotguard import heartbeat
    from spotguard.checkpoint.state import data
    from spotguard.errors import CheckpointMismatchError

    saved = torchdata.StatefulDataLoader(list(range(16)), batch_size=2)
    facts, states = data.loader_facts({"0": saved}), {"0": saved.state_dict()}
    now = {"0": torchdata.StatefulDataLoader(list(range(16)), batch_size=4)}
    refusing = FolderCheckpoints(str(tmp_path))
    with pytest.raises(CheckpointMismatchError, match=r"'0' was saved with batch_size=2 and has batch_size=4 now"):
        refusing.check_loaders(now, dict(states), facts, "checkpoint of step 3")
    assert refusing.refused and refusing._beat.flags & heartbeat.CONFIG_ERROR
    accepting = FolderCheckpoints(str(tmp_path), rebatch="accept")
    with caplog.at_level(logging.WARNING):
        accepting.check_loaders(now, dict(states), facts, "checkpoint of step 3")
    assert "(rebatch='accept')" in caplog.text and not accepting.refused
    with pytest.raises(ConfigError, match="rebatch must be one of"):
        FolderCheckpoints(str(tmp_path), rebatch="sometimes")
