"""A trainer's files hashed as it closes them (inotify), and never a stale hash in a manifest."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from spotguard import checkpoint
from spotguard.checkpoint.files import onclose
from spotguard.checkpoint.files.onclose import ClosedFileHashes
from spotguard.checkpoint.format import digest
from spotguard.storage import open_storage

pytestmark = pytest.mark.skipif(onclose._libc() is None, reason="needs Linux inotify")


@pytest.fixture
def hashed_where(monkeypatch) -> list[tuple[str, str]]:
    """(thread name, file name) of every file digest computed."""
    calls: list[tuple[str, str]] = []

    def counting(real):
        def digest_of(path, *args, **kw):
            calls.append((threading.current_thread().name, Path(path).name))
            return real(path, *args, **kw)

        return digest_of

    for name in ("chunked_file_digest", "read_file_digest"):  # the commit's map, the early hash's reads
        monkeypatch.setattr(digest, name, counting(getattr(digest, name)))
    return calls


def real_digest(path: Path) -> str:
    return digest.chunked_file_digest(path, digest.CHUNK, alg=digest.default_alg())


def test_files_closed_during_the_save_are_not_hashed_again_at_the_commit(tmp_path, hashed_where):
    storage = open_storage(str(tmp_path / "ckpt"))
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder) as hashes:
        torch.save({"w": torch.randn(512, 512)}, folder / "model.pt")
        (folder / "global_step7").mkdir()  # a folder the trainer makes: watched once its event is read
        deadline = time.monotonic() + 5  # (a file closed before that is hashed at the commit, as before)
        while folder / "global_step7" not in hashes._dirs.values() and time.monotonic() < deadline:
            time.sleep(0.005)
        torch.save({"m": torch.randn(256, 256)}, folder / "global_step7" / "optim.pt")
        checkpoint.write_dir(storage, 7, folder, reason="manual", known=hashes.known)
    at_commit = [name for thread, name in hashed_where if not thread.startswith("spotguard-onclose")]
    early = [name for thread, name in hashed_where if thread.startswith("spotguard-onclose")]
    assert sorted(early) == ["model.pt", "optim.pt"] and at_commit == [], hashed_where
    (info,) = checkpoint.scan(storage)
    checkpoint.verify(storage, info)  # the early digests are the files' own
    assert not [t for t in threading.enumerate() if t.name.startswith("spotguard-onclose")]


def test_a_file_written_again_after_it_was_hashed_gets_no_stale_hash(tmp_path):
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder) as hashes:
        torch.save({"w": torch.randn(64, 64)}, folder / "a.pt")
        assert hashes.known(folder / "a.pt", hashes.alg) == real_digest(folder / "a.pt")
        with open(folder / "a.pt", "r+b") as f:  # same size, same second: only the event tells
            f.seek(100)
            f.write(b"\xff" * 8)
            f.flush()
            assert hashes.known(folder / "a.pt", hashes.alg) is None  # still open: nothing to hand out
        # closed again: hashed again, and the answer is the new bytes' digest
        assert hashes.known(folder / "a.pt", hashes.alg) == real_digest(folder / "a.pt")
        (folder / "a.pt").unlink()
        assert hashes.known(folder / "a.pt", hashes.alg) is None
    assert hashes.known(folder / "b.pt", hashes.alg) is None


def test_a_hash_of_another_algorithm_or_after_the_block_is_not_handed_out(tmp_path):
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder, alg=digest.SHA256) as hashes:
        (folder / "state.json").write_text("{}")
        assert hashes.known(folder / "state.json", digest.BLAKE3) is None
        assert hashes.known(folder / "state.json", digest.SHA256) == digest.chunked_file_digest(
            folder / "state.json", digest.CHUNK, alg=digest.SHA256
        )
    assert hashes.known(folder / "state.json", digest.SHA256) is None  # nothing is watched any more


def test_without_inotify_every_file_is_hashed_at_the_commit(tmp_path, monkeypatch, hashed_where):
    monkeypatch.setattr(onclose, "_libc", lambda: None)
    storage = open_storage(str(tmp_path / "ckpt"))
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder) as hashes:
        torch.save({"w": torch.randn(8)}, folder / "model.pt")
        checkpoint.write_dir(storage, 1, folder, reason="manual", known=hashes.known)
    assert hashed_where == [("MainThread", "model.pt")]
    checkpoint.verify(storage, checkpoint.scan(storage)[0])


@pytest.mark.parametrize("sync", [True, False])
def test_each_file_is_synced_once_hashed_only_when_asked(tmp_path, monkeypatch, sync):
    synced: list[str] = []
    real = onclose.os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name.startswith("spotguard-onclose"):
            synced.append(Path(f"/proc/self/fd/{fd}").resolve().name)
        real(fd)

    monkeypatch.setattr(onclose.os, "fsync", fsync)
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder, sync=sync) as hashes:
        torch.save({"w": torch.randn(64, 64)}, folder / "a.pt")
        assert hashes.known(folder / "a.pt", hashes.alg) is not None
    assert synced == (["a.pt"] if sync else [])


def test_a_file_that_fails_its_early_hash_is_hashed_at_the_commit(tmp_path, monkeypatch):
    """The early hash is a head start only: one that fails (a file cut short while it was read) is no
    error of the commit, which hashes the file itself."""

    real = digest.read_file_digest

    def cut_short(path, *args, **kw):
        if threading.current_thread().name.startswith("spotguard-onclose"):
            raise digest.CheckpointCorruptError(f"{path}: cannot read it whole: cut short?")
        return real(path, *args, **kw)

    monkeypatch.setattr(digest, "read_file_digest", cut_short)
    storage = open_storage(str(tmp_path / "ckpt"))
    folder = tmp_path / "trainer"
    folder.mkdir()
    with ClosedFileHashes(folder) as hashes:
        torch.save({"w": torch.randn(8)}, folder / "model.pt")
        assert hashes.known(folder / "model.pt", hashes.alg) is None
        checkpoint.write_dir(storage, 1, folder, reason="manual", known=hashes.known)
    checkpoint.verify(storage, checkpoint.scan(storage)[0])


def _rewrite_while_hashed(folder: Path, seconds: float) -> int:
    """Another writer truncates and rewrites a file of the folder again and again, each close a hash."""
    data = bytes(range(256)) * (16 << 12)  # 16 MiB: one chunk
    with ClosedFileHashes(folder) as hashes:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            with open(folder / "rng_state.pth", "wb") as f:  # "wb": truncated under the hasher
                f.write(data)
        (folder / "rng_state.pth").write_bytes(data)
        return int(hashes.known(folder / "rng_state.pth", hashes.alg) == real_digest(folder / "rng_state.pth"))


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
def test_a_file_truncated_while_it_is_hashed_does_not_kill_the_process(tmp_path):
    # Two ranks saving into one folder write some files under the same name: a map of the first one's
    # bytes, cut off by the second's truncation, raised SIGBUS in the hasher and killed the rank.
    folder = tmp_path / "trainer"
    folder.mkdir()
    pid = os.fork()  # a SIGBUS would take the test's worker with it: the child takes the risk
    if pid == 0:
        code = 1
        try:
            code = 0 if _rewrite_while_hashed(folder, 3.0) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the hashing process died of signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0, "the last file's digest was not handed out right"
