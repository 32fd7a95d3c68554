"""Local backend: what killed writers leave behind is swept, what live writers hold is not."""

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


def test_a_save_sweeps_leftovers_of_killed_writers_on_this_host_only(tmp_path):
    host, dead, live = _host(), dead_pid(), os.getpid()
    root = tmp_path / "ckpt"
    (root / "step-00000007").mkdir(parents=True)
    leftovers = {
        "dead scratch": root / f".spotguard.tmp-{host}@{dead}-abc",
        "live scratch": root / f".spotguard.tmp-{host}@{live}-def",
        "other host": root / f".spotguard.tmp-elsewhere@{dead}-ghi",
        "untagged": root / ".spotguard.tmp-jkl",
    }
    for d in leftovers.values():
        d.mkdir()
        (d / "0-state.pt").write_bytes(b"partial")
    dead_tmp = root / "step-00000007" / f"state.pt.tmp-{host}@{dead}-1234abcd"
    live_tmp = root / "step-00000007" / f"manifest.json.tmp-{host}@{live}-1234abcd"
    dead_tmp.write_bytes(b"partial")
    live_tmp.write_bytes(b"{}")
    old_empty, new_empty = root / "step-00000003", root / "step-00000009"
    old_empty.mkdir()
    new_empty.mkdir()
    long_ago = time.time() - 3600
    os.utime(old_empty, (long_ago, long_ago))

    with LocalStorage(str(root)).scratch() as scratch:
        assert scratch.name.startswith(f".spotguard.tmp-{host}@{live}-")

    assert not leftovers["dead scratch"].exists() and not dead_tmp.exists() and not old_empty.exists()
    assert leftovers["live scratch"].exists() and leftovers["other host"].exists() and leftovers["untagged"].exists()
    assert live_tmp.exists() and new_empty.exists()  # a live writer's file; a directory just made
