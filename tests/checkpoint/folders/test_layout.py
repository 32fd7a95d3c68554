"""Checkpoint layout: manifest last, corruption falls back, retention, no unpickling of code."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard import checkpoint
from spotguard.checkpoint.folders import layout
from spotguard.checkpoint.format.manifest import check_file_name
from spotguard.errors import CheckpointExistsError, CheckpointMismatchError, ConfigError, NoLoadableCheckpointError
from spotguard.storage import LocalStorage, open_storage
from tests.helpers import chunked_digest


def make_guard(root: Path, **kw) -> tuple[spotguard.Guard, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    guard = spotguard.Guard(str(root), providers=[], **kw)
    guard.track(model=model)
    return guard, model


def bump(model: torch.nn.Linear, value: float) -> None:
    with torch.no_grad():
        model.weight.fill_(value)


def saved_steps(root: Path) -> list[int]:
    return [i.step for i in checkpoint.scan(open_storage(str(root))) if i.complete]


def test_manifest_lists_files_with_sizes_and_checksums(tmp_path):
    guard, _ = make_guard(tmp_path)
    guard.extra["epoch"] = 3
    manifest = guard.save(7, "periodic")
    data = json.loads((tmp_path / "step-00000007" / "manifest.json").read_text())
    assert data["step"] == 7 and data["reason"] == "periodic" and data["world_size"] == 1
    assert data["extra"] == {"epoch": 3}
    assert data["torch_version"] == torch.__version__ and data["spotguard_version"] == spotguard.__version__
    (entry,) = data["files"]
    state = tmp_path / "step-00000007" / "state.pt"
    assert entry["name"] == "state.pt" and entry["size"] == state.stat().st_size
    assert entry["digest"] == {"alg": "blake3", "chunk": 16 << 20, "value": chunked_digest(state.read_bytes())}
    assert manifest is not None and manifest.size == state.stat().st_size


def corrupt_flip(d: Path) -> None:
    f = d / "state.pt"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))


def corrupt_truncate(d: Path) -> None:
    f = d / "state.pt"
    f.write_bytes(f.read_bytes()[:-100])


def corrupt_no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def corrupt_manifest_not_json(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


def corrupt_state_missing(d: Path) -> None:
    (d / "state.pt").unlink()


@pytest.mark.parametrize(
    "corrupt", [corrupt_flip, corrupt_truncate, corrupt_no_manifest, corrupt_manifest_not_json, corrupt_state_missing]
)
def test_corrupted_newest_checkpoint_falls_back_to_previous(tmp_path, corrupt, caplog):
    guard, model = make_guard(tmp_path)
    bump(model, 1.0)
    guard.save(10, "periodic")
    bump(model, 2.0)
    guard.save(20, "periodic")
    corrupt(tmp_path / "step-00000020")

    fresh, fresh_model = make_guard(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert fresh.resume() == 10
    assert torch.all(fresh_model.weight == 1.0)
    assert any("step-00000020" in r.getMessage() for r in caplog.records), caplog.text


def test_all_checkpoints_corrupt_refuses_to_start_over_unless_asked_to(tmp_path, caplog):
    guard, _ = make_guard(tmp_path)
    guard.save(5, "periodic")
    corrupt_flip(tmp_path / "step-00000005")
    fresh, _ = make_guard(tmp_path)
    with pytest.raises(NoLoadableCheckpointError, match=r"step-00000005: .*checksum does not match"):
        fresh.resume()  # step 0 would silently redo the work of step 5
    on_purpose, _ = make_guard(tmp_path, on_unloadable="fresh")
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert on_purpose.resume() == 0
    assert "checksum does not match" in caplog.text and "on_unloadable='fresh'" in caplog.text


def test_retention_keeps_exactly_keep_and_ignores_foreign_directories(tmp_path):
    (tmp_path / "notes").mkdir(parents=True)
    (tmp_path / "notes" / "readme.txt").write_text("mine")
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "unrelated.bin").write_text("not ours: no manifest")
    guard, model = make_guard(tmp_path, keep=2)
    for step in (2, 4, 6, 8, 10):
        bump(model, step)
        guard.save(step, "periodic")
        assert saved_steps(tmp_path) == [s for s in (2, 4, 6, 8, 10) if s <= step][-2:]
    assert (tmp_path / "notes" / "readme.txt").read_text() == "mine"
    assert (tmp_path / "step-00000001" / "unrelated.bin").exists()
    assert not (tmp_path / "step-00000002").exists()


def test_retention_never_deletes_newest_complete_when_newer_ones_are_corrupt(tmp_path):
    guard, model = make_guard(tmp_path, keep=1)
    guard.save(1, "periodic")
    # A corrupt (manifest-bearing) newer directory must not count towards `keep`.
    (tmp_path / "step-00000005").mkdir()
    (tmp_path / "step-00000005" / "manifest.json").write_text("garbage")
    guard.save(2, "periodic")
    assert saved_steps(tmp_path) == [2]
    assert (tmp_path / "step-00000005" / "manifest.json").exists()


def test_retention_removes_older_checkpoints_whose_manifest_names_a_missing_file(tmp_path):
    """Corrupt for good (an in-flight file deleted under a save that then committed): garbage once a newer
    checkpoint is complete; a newer one is kept, and so is one whose manifest does not parse."""
    st = open_storage(str(tmp_path))
    for step in (1, 2, 3, 9):
        checkpoint.write(st, step, {"state.pt": lambda f, s=step: f.write(bytes([s]) * 100)}, reason="periodic")
    for step in (2, 9):
        (tmp_path / f"step-{step:08d}" / "state.pt").unlink()
    (tmp_path / "step-00000003" / "manifest.json").write_text("garbage")
    checkpoint.write(st, 4, {"state.pt": lambda f: f.write(b"4" * 100)}, reason="periodic")
    assert checkpoint.prune(st, keep=5) == [2]
    assert [(i.step, i.status) for i in checkpoint.scan(st)] == [
        (1, "complete"),
        (3, "corrupt"),
        (4, "complete"),
        (9, "corrupt"),
    ]


def test_a_step_whose_checkpoint_is_corrupt_for_good_can_be_saved_again(tmp_path, caplog):
    """Else a resume that skipped it would redo the steps up to it and never be able to save it."""
    st = open_storage(str(tmp_path))
    checkpoint.write(st, 5, {"state.pt": lambda f: f.write(b"a" * 100)}, reason="periodic")
    (tmp_path / "step-00000005" / "state.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        checkpoint.write(st, 5, {"state.pt": lambda f: f.write(b"b" * 100)}, reason="periodic")
    assert "corrupt for good: step-00000005: missing file(s) state.pt" in caplog.text
    assert [(i.step, i.status) for i in checkpoint.scan(st)] == [(5, "complete")]
    assert layout.prepare(st, "step-00000005") == "exists"  # a whole one is never replaced
    (tmp_path / "step-00000005" / "state.pt").write_bytes(b"short")
    assert layout.prepare(st, "step-00000005") == "ok" and not (tmp_path / "step-00000005").exists()


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_in_checkpoint_is_not_executed(tmp_path, caplog):
    guard, model = make_guard(tmp_path)
    bump(model, 1.0)
    guard.save(1, "periodic")
    # An attacker who can write the bucket replaces state.pt and fixes up the manifest to match.
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker  # type: ignore[attr-defined]
    d = tmp_path / "step-00000002"
    d.mkdir()
    torch.save({"step": 2, "objects": {"model": exploit}}, d / "state.pt")
    import hashlib

    blob = (d / "state.pt").read_bytes()
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "format": "spotguard/2",
                "step": 2,
                "reason": "periodic",
                "time": "2026-01-01T00:00:00+00:00",
                "files": [{"name": "state.pt", "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}],
            }
        )
    )
    assert pickle.loads(pickle.dumps(1)) == 1  # sanity: pickle itself works here
    fresh, fresh_model = make_guard(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spotguard"):
        assert fresh.resume() == 1
    assert not marker.exists()
    assert "cannot be loaded safely" in caplog.text
    assert torch.all(fresh_model.weight == 1.0)


def test_manifest_with_path_traversal_is_corrupt(tmp_path):
    d = tmp_path / "step-00000003"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "format": checkpoint.FORMAT,
                "step": 3,
                "reason": "periodic",
                "time": "t",
                "files": [{"name": "../../etc/passwd", "size": 1, "sha256": "0" * 64}],
            }
        )
    )
    (info,) = checkpoint.scan(open_storage(str(tmp_path)))
    assert info.status == "corrupt" and "unsafe file name" in info.problem


def test_leftover_of_interrupted_save_is_ignored_then_replaced(tmp_path):
    guard, model = make_guard(tmp_path)
    guard.save(4, "periodic")
    leftover = tmp_path / "step-00000008"
    leftover.mkdir()
    (leftover / "state.pt").write_bytes(b"half a file")
    (leftover / "state.pt.tmp-123-abcd").write_bytes(b"temp")
    infos = checkpoint.scan(open_storage(str(tmp_path)))
    assert [(i.step, i.status) for i in infos] == [(4, "complete"), (8, "incomplete")]
    fresh, fresh_model = make_guard(tmp_path)
    assert fresh.resume() == 4
    bump(fresh_model, 8.0)
    assert fresh.save(8, "periodic") is not None
    assert saved_steps(tmp_path) == [4, 8]
    again, again_model = make_guard(tmp_path)
    assert again.resume() == 8 and torch.all(again_model.weight == 8.0)


def test_same_step_is_never_committed_twice(tmp_path):
    guard, _ = make_guard(tmp_path)
    guard.save(3, "periodic")
    before = (tmp_path / "step-00000003" / "manifest.json").read_bytes()
    assert guard.save(3, "emergency") is None  # same guard: already saved
    other, _ = make_guard(tmp_path)  # another writer: the write-once manifest refuses
    with pytest.raises(CheckpointExistsError):
        checkpoint.write(other.storage, 3, {"state.pt": lambda f: f.write(b"x")}, reason="periodic")
    assert (tmp_path / "step-00000003" / "manifest.json").read_bytes() == before


def test_checkpoint_of_other_objects_is_a_clear_mismatch(tmp_path):
    guard, _ = make_guard(tmp_path)
    guard.save(1, "periodic")
    other = spotguard.Guard(str(tmp_path), providers=[])
    other.track(net=torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointMismatchError, match="net"):
        other.resume()
    shaped = spotguard.Guard(str(tmp_path), providers=[])
    shaped.track(model=torch.nn.Linear(5, 3))
    with pytest.raises(CheckpointMismatchError, match="model"):
        shaped.resume()


def test_extra_must_be_json(tmp_path, caplog):
    guard, _ = make_guard(tmp_path)
    guard.extra["when"] = object()
    with pytest.raises(ConfigError, match="JSON"):
        guard.save(1, "manual")
    assert saved_steps(tmp_path) == []


def _trainer_folder(root: Path) -> Path:
    """A folder as a trainer writes it: several files, one nested."""
    folder = root / "checkpoint-12"
    (folder / "shards").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "trainer_state.json").write_text('{"global_step": 12}')
    (folder / "shards" / "rank-0.bin").write_bytes(b"\x00\x01" * 50)
    return folder


def test_write_dir_commits_a_trainer_folder_manifest_last(tmp_path):
    folder = _trainer_folder(tmp_path / "out")
    storage = open_storage(str(tmp_path / "ckpt"))
    manifest = checkpoint.write_dir(storage, 12, folder, reason="emergency", extra={"epoch": 1})
    assert sorted(f.name for f in manifest.files) == ["model.safetensors", "shards/rank-0.bin", "trainer_state.json"]
    info = checkpoint.latest(storage)
    assert info is not None and info.step == 12 and info.manifest == manifest
    checkpoint.verify(storage, info)
    got = checkpoint.fetch(storage, info, tmp_path / "pulled")
    for f in manifest.files:
        assert (got / f.name).read_bytes() == (folder / f.name).read_bytes()
    with pytest.raises(CheckpointExistsError):
        checkpoint.write_dir(storage, 12, folder, reason="emergency")


def test_fetch_refuses_a_tampered_file(tmp_path):
    folder = _trainer_folder(tmp_path / "out")
    storage = open_storage(str(tmp_path / "ckpt"))
    checkpoint.write_dir(storage, 12, folder, reason="periodic")
    stored = tmp_path / "ckpt" / "step-00000012" / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[3] ^= 0xFF  # same size: only the checksum can tell
    stored.unlink()  # the stored file may be a hard link of the trainer's: replace it, do not edit it
    stored.write_bytes(bytes(data))
    info = checkpoint.latest(storage)
    with pytest.raises(spotguard.CheckpointCorruptError, match="checksum does not match"):
        checkpoint.fetch(storage, info, tmp_path / "pulled")


def test_write_dir_rejects_empty_folders_and_unsafe_names(tmp_path):
    storage = open_storage(str(tmp_path / "ckpt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no files"):
        checkpoint.write_dir(storage, 1, tmp_path / "empty", reason="manual")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "epoch=0-step=1.ckpt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="invalid checkpoint file name"):
        checkpoint.write_dir(storage, 1, odd, reason="manual")
    assert checkpoint.scan(storage) == []


def test_names_may_start_with_a_dot_but_never_leave_the_checkpoint():
    """DCP folders (Lightning's sharded FSDP checkpoint) hold ``.metadata``; ``.`` and ``..`` stay refused."""
    for name in (".metadata", "lightning.ckpt/.metadata", "a/.b/c", "...", "..a"):
        check_file_name(name)
    for name in (".", "..", "../x", "a/..", "a/../b", "a/./b", "/a", "a//b", "", "-x", "a\\b", "manifest.json"):
        with pytest.raises(ConfigError, match="invalid checkpoint file name"):
            check_file_name(name)


def test_a_trainers_files_are_stored_while_they_are_hashed_not_after(tmp_path, monkeypatch):
    """A trainer's emergency folder: the fsync (or upload) of each file overlaps the hashing of the others."""
    from spotguard.checkpoint.format import digest

    folder = tmp_path / "trainer"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.bin").write_bytes(os.urandom(1 << 16))
    last_hashed = threading.Event()
    real_digest = digest.read_file_digest

    def hashing(path, *a, **kw):
        if path.name == "part-2.bin":
            last_hashed.set()
        return real_digest(path, *a, **kw)

    monkeypatch.setattr(digest, "read_file_digest", hashing)
    overlapped: list[bool] = []

    class Watching(LocalStorage):
        def put_file(self, key, path, **kw):
            overlapped.append(last_hashed.wait(10))  # the first stores wait for the last hash: only if concurrent
            super().put_file(key, path, **kw)

    manifest = layout.write_dir(Watching(str(tmp_path / "ckpt")), 1, folder, reason="emergency")
    assert overlapped == [True, True, True]
    assert [f.name for f in manifest.files] == ["part-0.bin", "part-1.bin", "part-2.bin"]
