"""Local backend: what killed writers leave behind is swept, what anyone else holds is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spotguard.storage.local import LocalStorage, _host


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def age(*paths, seconds: float = 3600) -> None:
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then))


def test_a_save_sweeps_leftovers_of_killed_writers_on_this_host_only(tmp_path):
    host, dead, live = _host(), dead_pid(), os.getpid()
    root = tmp_path / "ckpt"
    step = root / "step-00000007"
    step.mkdir(parents=True)
    scratch = {
        "dead": root / f".spotguard.tmp-{host}@{dead}-abc",
        "dead, still changing": root / f".spotguard.tmp-{host}@{dead}-xyz",  # another PID namespace
        "live": root / f".spotguard.tmp-{host}@{live}-def",
        "other host": root / f".spotguard.tmp-elsewhere@{dead}-ghi",
        "untagged": root / ".spotguard.tmp-jkl",
    }
    for name, d in scratch.items():
        d.mkdir()
        (d / "0-state.pt").write_bytes(b"partial")
        if name != "dead, still changing":
            age(d / "0-state.pt", d)
    dead_tmp = step / f"state.pt.tmp-{host}@{dead}-1234abcd"
    live_tmp = step / f"manifest.json.tmp-{host}@{live}-1234abcd"
    (step / "shards").mkdir()
    nested_tmp = step / "shards" / f"data-0.distcp.tmp-{host}@{dead}-5678abcd"  # a sharded save's
    dead_tmp.write_bytes(b"partial")
    live_tmp.write_bytes(b"{}")
    nested_tmp.write_bytes(b"partial")
    age(dead_tmp, live_tmp, nested_tmp)
    old_empty, new_empty, users = root / "step-00000003", root / "step-00000009", root / "lost+found"
    for d in (old_empty, new_empty, users):
        d.mkdir()
    age(old_empty, users)

    with LocalStorage(str(root)).scratch() as made:
        assert made.name.startswith(f".spotguard.tmp-{host}@{live}-")

    assert not scratch["dead"].exists() and not dead_tmp.exists() and not old_empty.exists()
    assert not nested_tmp.exists()
    for name in ("dead, still changing", "live", "other host", "untagged"):
        assert scratch[name].exists(), name
    assert live_tmp.exists() and new_empty.exists() and users.exists()
