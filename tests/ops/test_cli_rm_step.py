"""``spotguard rm URL --step N``: ``--dry-run`` deletes nothing, ``--min-age`` (an ``--incomplete`` filter) is refused."""

from __future__ import annotations

import json

from spotguard import checkpoint
from spotguard.ops.cli import main
from spotguard.storage import open_storage


def steps(root) -> list[int]:
    return [i.step for i in checkpoint.scan(open_storage(str(root)))]


def write(root, *numbers: int) -> None:
    st = open_storage(str(root))
    for n in numbers:
        checkpoint.write(st, n, {"state.pt": lambda f, n=n: f.write(bytes([n]) * 100)}, reason="periodic")


def test_rm_step_dry_run_says_would_delete_and_keeps_the_checkpoint_then_the_real_run_deletes(tmp_path, capsys):
    root = tmp_path / "ckpt"
    write(root, 10, 20)
    assert main(["rm", str(root), "--step", "10", "--dry-run"]) == 0
    assert capsys.readouterr().out == f"would delete {root / 'step-00000010'} (complete)\n"
    assert steps(root) == [10, 20]  # was: deleted despite --dry-run
    assert main(["rm", str(root), "--step", "10", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"would_delete": str(root / "step-00000010"), "step": 10, "status": "complete", "problem": None}
    assert steps(root) == [10, 20]
    assert main(["rm", str(root), "--step", "10"]) == 0
    assert capsys.readouterr().out == f"deleted {root / 'step-00000010'} (complete)\n"
    assert steps(root) == [20]


def test_rm_step_with_min_age_is_refused_and_deletes_nothing(tmp_path, capsys):
    root = tmp_path / "ckpt"
    write(root, 10)
    assert main(["rm", str(root), "--step", "10", "--min-age", "1d"]) == 2  # was: ignored, deleted at once
    err = capsys.readouterr().err
    assert err.startswith("spotguard: error: --min-age goes with --incomplete"), err
    assert steps(root) == [10]


def test_rm_incomplete_still_defaults_to_a_minimum_age_of_one_hour(tmp_path, capsys):
    root = tmp_path / "ckpt"
    open_storage(str(root)).put_bytes("step-00000030/state.pt", b"leftover of a killed save")
    assert main(["rm", str(root), "--incomplete"]) == 0
    assert "skipped" in capsys.readouterr().out and (root / "step-00000030").exists()


def test_rm_step_deletes_every_revision_of_the_step(tmp_path, capsys):
    """A final save cut before its prune leaves ``step-N/`` beside ``step-N.r1/``: deleting only the newest
    made the superseded one that step's checkpoint again."""
    root = tmp_path / "ckpt"
    write(root, 10, 20)
    st = open_storage(str(root))
    checkpoint.write_dir(st, 10, _folder(tmp_path), reason="final", revision=1)
    assert [i.name for i in checkpoint.scan(st)] == ["step-00000010", "step-00000010.r1", "step-00000020"]
    assert main(["rm", str(root), "--step", "10"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"deleted {root / 'step-00000010.r1'} (complete)",
        f"deleted {root / 'step-00000010'} (complete)",
    ]
    assert steps(root) == [20]


def test_ls_of_one_checkpoints_folder_lists_that_checkpoint(tmp_path, capsys):
    """As ``verify URL/step-N`` does; it printed "no checkpoints" with exit 0."""
    root = tmp_path / "ckpt"
    write(root, 10, 20)
    assert main(["ls", str(root / "step-00000010"), "--json"]) == 0
    assert [json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()] == [10]
    assert main(["ls", str(root / "step-00000030")]) == 1
    assert "no such checkpoint" in capsys.readouterr().err


def _folder(tmp_path):
    out = tmp_path / "final-10"
    out.mkdir()
    (out / "state.pt").write_bytes(b"final")
    return out
