"""Lightning's planned resume (spotguard/integrations/_planned_resume.py): before the process group
exists, a rank under torchrun names its node's copy of the newest complete checkpoint. The fetch into
it, and the move of an older one when the newest does not verify, run in tests/workers/dist_folders.py."""

from __future__ import annotations

from spotguard.checkpoint import write_dir
from spotguard.checkpoint.folders import folders
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.integrations._folders import FolderCheckpoints
from spotguard.integrations._planned_resume import PlannedResume
from spotguard.storage import LocalStorage


def planner(tmp_path, monkeypatch, **env) -> PlannedResume:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    checkpoints = FolderCheckpoints(
        LocalStorage(str(tmp_path / "ckpt")), work_dir=str(tmp_path / "work"), lease_ttl=None
    )
    return PlannedResume(checkpoints, RankFiles(lambda name: None))


def commit(tmp_path, step: int, manifest: bool = True) -> None:
    (tmp_path / f"s{step}").mkdir()
    (tmp_path / f"s{step}" / "lightning.ckpt").write_bytes(bytes([step]) * 10)
    write_dir(LocalStorage(str(tmp_path / "ckpt")), step, tmp_path / f"s{step}", reason="periodic", world_size=2)
    if not manifest:
        (tmp_path / "ckpt" / f"step-{step:08d}" / "manifest.json").unlink()


def test_under_torchrun_a_rank_names_its_nodes_copy_of_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    commit(tmp_path, 4)
    commit(tmp_path, 8)
    commit(tmp_path, 12, manifest=False)  # cut short: not a checkpoint
    plan = planner(tmp_path, monkeypatch, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4")
    storage = plan.checkpoints.storage
    assert plan.plan() == folders.node_folder(storage, 8, str(tmp_path / "work")) and plan.step == 8
    assert "node2-step-00000008" in str(plan.planned)  # ranks 2 and 3 share node 2's copy
    assert not plan.planned.exists()  # fetched later, once the process group is up


def test_nothing_is_planned_in_one_process_under_lightnings_own_launcher_or_without_a_checkpoint(tmp_path, monkeypatch):
    assert planner(tmp_path, monkeypatch, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2").plan() is None  # none yet
    commit(tmp_path, 4)
    assert planner(tmp_path, monkeypatch).plan() is None  # one process: fetched at once, as before
    assert planner(tmp_path, monkeypatch, LOCAL_RANK="1", WORLD_SIZE="2").plan() is None  # Lightning's: no RANK
    assert planner(tmp_path, monkeypatch, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2").plan() is not None
