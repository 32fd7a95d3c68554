"""``--json`` on verify, pull and rm: one JSON document per result on stdout, the exit codes of the README."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from spotguard import checkpoint
from spotguard.ops.cli import main
from spotguard.storage import open_storage
from tests.helpers import subprocess_env


def fill(root) -> None:
    st = open_storage(str(root))
    for step in (10, 20):
        checkpoint.write(st, step, {"state.pt": lambda f, n=step: f.write(os.urandom(1000 + n))}, reason="periodic")
    st.put_bytes("step-00000030/state.pt", b"leftover of a killed save")


def docs(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_verify_json_one_document_per_checkpoint_and_exit_1_when_one_is_corrupt(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    assert main(["verify", str(root), "--json"]) == 0
    got = {d["step"]: d for d in docs(capsys)}
    assert {s: d["status"] for s, d in got.items()} == {10: "ok", 20: "ok", 30: "incomplete"}
    assert got[10] == {
        "url": str(root / "step-00000010"),
        "name": "step-00000010",
        "step": 10,
        "status": "ok",
        "problem": None,
    }
    with open(root / "step-00000020" / "state.pt", "r+b") as f:
        f.write(b"\0")
    assert main(["verify", str(root), "--json"]) == 1
    got = {d["step"]: d for d in docs(capsys)}
    assert got[20]["status"] == "corrupt" and "checksum does not match the manifest" in got[20]["problem"]
    assert main(["verify", str(root / "step-00000010"), "--json"]) == 0
    assert [d["status"] for d in docs(capsys)] == ["ok"]


def test_verify_json_with_nothing_to_verify_is_an_error_document(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "empty"), "--json"]) == 1
    (doc,) = docs(capsys)
    assert doc["exit_code"] == 1 and "no checkpoints in" in doc["error"]
    fill(tmp_path / "ckpt")
    assert main(["verify", str(tmp_path / "ckpt" / "step-00000040"), "--json"]) == 1
    (doc,) = docs(capsys)
    assert "no such checkpoint" in doc["error"] and doc["url"].endswith("step-00000040")


def test_pull_json_reports_the_checkpoint_or_the_error(tmp_path, capsys):
    root, dest = tmp_path / "ckpt", tmp_path / "dest"
    fill(root)
    assert main(["pull", str(root), str(dest), "--json"]) == 0
    (doc,) = docs(capsys)
    assert doc["step"] == 20 and doc["verified"] and doc["url"] == str(dest / "step-00000020")
    assert doc["size"] == (root / "step-00000020" / "state.pt").stat().st_size
    assert main(["pull", str(root), str(dest), "--json"]) == 1  # never overwrites
    (doc,) = docs(capsys)
    assert "already exists" in doc["error"] and doc["exit_code"] == 1
    assert main(["pull", str(root), str(dest), "--step", "30", "--json"]) == 1
    assert "incomplete" in docs(capsys)[0]["error"]


def test_rm_json_one_document_per_deletion(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    assert main(["rm", str(root), "--incomplete", "--json"]) == 0
    (doc,) = docs(capsys)  # written just now: a save may still be writing it
    assert doc["skipped"] == str(root / "step-00000030") and "minimum age 1 h" in doc["why"]
    assert main(["rm", str(root), "--incomplete", "--min-age", "0", "--json"]) == 0
    (doc,) = docs(capsys)
    assert doc["deleted"] == str(root / "step-00000030") and doc["status"] == "incomplete"
    assert main(["rm", str(root), "--incomplete", "--json"]) == 0
    assert docs(capsys) == []  # nothing left to delete: no document
    assert main(["rm", str(root), "--step", "10", "--json"]) == 0
    assert docs(capsys) == [{"deleted": str(root / "step-00000010"), "step": 10, "status": "complete", "problem": None}]
    assert main(["rm", str(root), "--step", "10", "--json"]) == 1
    assert "no checkpoint of step 10" in docs(capsys)[0]["error"]


def test_an_error_under_json_is_a_document_on_stdout_and_logs_stay_on_stderr(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", "-v", "ls", "s3://", "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    (doc,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert doc["exit_code"] == 2 and doc["type"] == "ConfigError" and doc["error"] in proc.stderr


def test_verify_names_a_checkpoint_with_an_unreadable_manifest_once(tmp_path, capsys):
    root = tmp_path / "ckpt"
    fill(root)
    (root / "step-00000020" / "manifest.json").write_text("garbage")
    assert main(["verify", str(root)]) == 1
    line = next(t for t in capsys.readouterr().out.splitlines() if "step-00000020" in t)
    assert line.startswith("step-00000020: CORRUPT: invalid manifest") and line.count("step-00000020") == 1, line
