"""The CLI on a checkpoint of a newer spotguard's manifest format: shown as such, refused with the
upgrade message, deletable; the supervisor neither prefetches an older checkpoint nor starts the job."""

from __future__ import annotations

import json
import os
import sys

from spotguard import checkpoint
from spotguard.ops.cli import main
from spotguard.storage import open_storage

UPGRADE = "pip install -U spotguard"


def fill(root) -> None:
    """Steps 10 and 20, real checkpoints; step 20 rewritten as a future spotguard would write it."""
    st = open_storage(str(root))
    for step in (10, 20):
        checkpoint.write(st, step, {"state.pt": lambda f, n=step: f.write(os.urandom(1000 + n))}, reason="periodic")
    path = root / "step-00000020" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(format="spotguard/99", spotguard_version="9.9.0")
    path.write_text(json.dumps(manifest))


def docs(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_ls_shows_a_newer_format_with_the_upgrade_message(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.split()[0] == "20"]
    assert "newer-format (" in row and "spotguard/99" in row and "spotguard 9.9.0" in row and UPGRADE in row
    assert main(["ls", str(root), "--json", "--verify"]) == 0
    got = {d["step"]: d for d in docs(capsys.readouterr().out)}
    assert got[10]["status"] == "complete" and got[10]["verified"] is True
    assert got[20]["status"] == "newer-format" and UPGRADE in got[20]["problem"] and got[20]["verified"] is None


def test_verify_exits_1_with_the_upgrade_message(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "step-00000010: ok" in out
    assert "step-00000020: NEWER FORMAT: " in out and "spotguard/99" in out and UPGRADE in out
    assert main(["verify", str(root / "step-00000020"), "--json"]) == 1
    (doc,) = docs(capsys.readouterr().out)
    assert doc["status"] == "newer-format" and "spotguard 9.9.0" in doc["problem"] and UPGRADE in doc["problem"]


def test_pull_refuses_the_newest_of_a_newer_format_instead_of_pulling_an_older_one(tmp_path, capsys):
    root, dest = tmp_path / "ckpt", tmp_path / "dest"
    fill(root)
    assert main(["pull", str(root), str(dest), "--json"]) == 2
    (doc,) = docs(capsys.readouterr().out)
    assert doc["type"] == "CheckpointFormatError" and UPGRADE in doc["error"]
    assert not dest.exists() or not any(dest.iterdir())
    assert main(["pull", str(root), str(dest), "--step", "20", "--json"]) == 1
    (doc,) = docs(capsys.readouterr().out)
    assert "is newer-format" in doc["error"] and UPGRADE in doc["error"]
    assert main(["pull", str(root), str(dest), "--step", "10", "--json"]) == 0  # an older one on request


def test_rm_deletes_a_newer_format_checkpoint_only_when_asked(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    assert main(["rm", str(root), "--incomplete", "--json"]) == 0
    assert docs(capsys.readouterr().out) == []
    assert (root / "step-00000020" / "manifest.json").exists()
    assert main(["rm", str(root), "--step", "20", "--json"]) == 0
    (doc,) = docs(capsys.readouterr().out)
    assert doc["status"] == "newer-format" and doc["deleted"] == str(root / "step-00000020")
    assert not (root / "step-00000020").exists()
    assert [i.step for i in checkpoint.scan(open_storage(str(root)))] == [10]


def test_run_with_prefetch_refuses_to_start_the_job_on_an_older_checkpoint(tmp_path, capsys):
    root, local, started = tmp_path / "ckpt", tmp_path / "nvme", tmp_path / "started"
    fill(root)
    job = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    argv = ["run", "--storage", str(root), "--local-dir", str(local), "--prefetch", "--max-restarts", "0", "--json"]
    assert main([*argv, "--", *job]) == 2
    summary = docs(capsys.readouterr().out)[-1]
    assert summary["outcome"] == "gave_up" and "spotguard/99" in summary["error"] and UPGRADE in summary["error"]
    assert not started.exists() and summary["starts"] == 0
    assert not local.exists() or checkpoint.scan(open_storage(str(local))) == []  # step 10 was not prefetched
