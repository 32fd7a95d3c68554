"""The trainers' own saves are hashed file by file as they are written, not all again at the commit.

In process, a real Trainer (``hf_train``, a checkpoint at step 2) and Accelerator: the digests of the files the trainer closed first come from
the ``spotguard-onclose`` thread while it writes the next ones; the committed checkpoint verifies.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from spotguard import checkpoint
from spotguard.checkpoint.files import onclose
from spotguard.checkpoint.format import digest
from spotguard.storage import open_storage
from tests.integrations.test_untracked import hf_train

pytestmark = pytest.mark.skipif(onclose._libc() is None, reason="needs Linux inotify")


@pytest.fixture
def hashed(monkeypatch) -> dict[str, list[str]]:
    """File names hashed early (on the watcher's thread) and at the commit (any other thread)."""
    seen: dict[str, list[str]] = {"early": [], "commit": []}

    def counting(real):
        def digest_of(path, *args, **kw):
            early = threading.current_thread().name.startswith("spotguard-onclose")
            seen["early" if early else "commit"].append(Path(path).name)
            return real(path, *args, **kw)

        return digest_of

    for name in ("chunked_file_digest", "read_file_digest"):  # the commit's map, the early hash's reads
        monkeypatch.setattr(digest, name, counting(getattr(digest, name)))
    return seen


def verified(storage_dir: Path) -> checkpoint.CheckpointInfo:
    """The newest checkpoint, read back (verifying hashes every file again: look at ``hashed`` before)."""
    storage = open_storage(str(storage_dir))
    info = checkpoint.latest(storage)
    assert info is not None
    checkpoint.verify(storage, info)  # the early digests are those of the committed bytes
    return info


def test_hf_trainers_files_are_hashed_as_it_writes_them(tmp_path, hashed):
    assert hf_train(tmp_path / "ckpt", tmp_path / "out", callbacks=[], max_steps=2) == 0
    seen = {k: list(v) for k, v in hashed.items()}
    info = verified(tmp_path / "ckpt")
    assert info.step == 2 and info.manifest is not None
    names = {Path(f.name).name for f in info.manifest.files}
    # The weights and the optimizer come first and are the bulk: hashed while the Trainer writes on.
    assert {"model.safetensors", "optimizer.pt"} <= set(seen["early"]) <= names, seen
    assert not {"model.safetensors", "optimizer.pt"} & set(seen["commit"]), seen
    assert not [t for t in threading.enumerate() if t.name.startswith("spotguard-onclose")]


def test_accelerator_guards_files_are_hashed_as_save_state_writes_them(tmp_path, hashed, accelerator):
    from spotguard.integrations.accelerate import AcceleratorGuard

    acc, _ = accelerator(with_optimizer=True)
    with AcceleratorGuard(acc, str(tmp_path / "ckpt"), providers=[], lease_ttl=None) as guard:
        guard.save(1)
    seen = {k: list(v) for k, v in hashed.items()}
    info = verified(tmp_path / "ckpt")
    assert info.manifest is not None
    names = {Path(f.name).name for f in info.manifest.files}
    assert {"model.safetensors", "optimizer.bin"} <= set(seen["early"]) <= names, seen
    assert not {"model.safetensors", "optimizer.bin"} & set(seen["commit"]), seen
