"""A hostile manifest (nested too deep, a huge chunk_size or world_size, too many bytes or files) is a
corrupt checkpoint: ``ls`` and ``verify`` report it, ``pull`` and resume take the older good one, and no
``RecursionError`` or ``MemoryError`` escapes (both did before the bounds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import spotguard
from spotguard.checkpoint.format import bounds
from spotguard.checkpoint.format.manifest import FileEntry, Manifest
from spotguard.errors import CheckpointCorruptError, ConfigError
from spotguard.ops.cli import main


def _nested(depth: int) -> str:
    """An object (as ``extra`` must be) holding lists nested ``depth`` deep."""
    return '{"x": ' + "[" * depth + "]" * depth + "}"


def _with_extra(extra_json: str) -> Callable[[dict], str]:
    def edit(doc: dict) -> str:
        doc.pop("extra", None)
        return json.dumps(doc)[:-1] + f', "extra": {extra_json}}}'

    return edit


def _setting(path: tuple, value: object) -> Callable[[dict], str]:
    def edit(doc: dict) -> str:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return json.dumps(doc)

    return edit


HOSTILE = {
    "nested-100000": _with_extra(_nested(100_000)),  # RecursionError out of json.loads
    "nested-200": _with_extra(_nested(200)),  # parses, but more than any reader should walk
    "chunk_size-1e18": _setting(("files", 0, "chunk_size"), 10**18),  # MemoryError in verification
    "world_size-1e18": _setting(("world_size",), 10**18),
    "over-max-bytes": _with_extra(json.dumps({"pad": "x" * bounds.MAX_BYTES})),
}


def make_guard(root: Path, value: float) -> tuple[spotguard.Guard, torch.nn.Linear]:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return spotguard.Guard(str(root), providers=[], keep=10).track(model=model), model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_manifest_is_corrupt_everywhere_and_resume_falls_back(case, tmp_path, capsys):
    root = tmp_path / "run"
    for step in (1, 2):
        guard, _ = make_guard(root, float(step))
        guard.save(step, "periodic")
    manifest = root / "step-00000002" / "manifest.json"
    manifest.write_text(HOSTILE[case](json.loads(manifest.read_text())))

    assert main(["ls", "--json", str(root)]) == 0
    listed = {d["step"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert listed[1]["status"] == "complete"
    assert listed[2]["status"] == "corrupt" and "invalid manifest" in listed[2]["problem"]
    assert len(listed[2]["problem"]) < 500  # names the limit, does not echo the document

    assert main(["verify", str(root)]) == 1
    assert "step-00000002: CORRUPT" in capsys.readouterr().out

    assert main(["pull", str(root), "--step", "2", str(tmp_path / "two")]) == 1
    assert main(["pull", str(root), str(tmp_path / "newest")]) == 0  # the newest good one
    assert (tmp_path / "newest" / "step-00000001" / "manifest.json").exists()

    guard, model = make_guard(root, 0.0)
    assert guard.resume() == 1 and torch.all(model.weight == 1.0)


def test_a_manifest_listing_too_many_files_is_corrupt(monkeypatch):
    monkeypatch.setattr(bounds, "MAX_FILES", 10)  # the rule, not 200,000 entries' worth of JSON
    entry = {"name": "f", "size": 1, "sha256": "0" * 64, "chunk_size": 16 << 20}
    doc = {"format": "spotguard/2", "step": 1, "reason": "periodic", "time": "t"}
    doc["files"] = [dict(entry, name=f"f{i}") for i in range(bounds.MAX_FILES + 1)]
    with pytest.raises(CheckpointCorruptError, match=f"more than {bounds.MAX_FILES}"):
        Manifest.from_bytes(json.dumps(doc).encode())
    doc["files"] = doc["files"][:2]  # the same entries, fewer: valid
    assert len(Manifest.from_bytes(json.dumps(doc).encode()).files) == 2


def test_a_writer_never_commits_a_manifest_readers_would_refuse():
    files = (FileEntry("state.pt", 1, "0" * 64, 16 << 20),)
    deep: list = []
    for _ in range(bounds.MAX_DEPTH):
        deep = [deep]
    with pytest.raises(ConfigError, match="guard.extra nested too deep"):
        Manifest(3, "periodic", files, extra={"x": deep}).to_bytes()
    with pytest.raises(ConfigError, match="guard.extra too large"):
        Manifest(3, "periodic", files, extra={"x": "y" * bounds.MAX_BYTES}).to_bytes()
    ok = Manifest(3, "periodic", files, extra={"x": [[[1]]]})
    assert Manifest.from_bytes(ok.to_bytes()) == ok
