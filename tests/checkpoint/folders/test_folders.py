"""Trainer folders written by several ranks, committed as one checkpoint and fetched back
(spotguard/checkpoint/folders/folders.py), with real gloo processes that share no folder."""

from __future__ import annotations

import sys

import pytest

from spotguard.checkpoint import scan
from spotguard.checkpoint.folders import folders
from spotguard.storage import open_storage

from ...helpers import WORKERS, run_ranks, worker_results


def test_assign_gives_each_file_to_the_lowest_rank_that_has_it():
    assert folders.assign([{"a": 1, "b": 2}, {"b": 2, "c": 3}, {"c": 3, "d": 4}]) == {"a": 0, "b": 0, "c": 1, "d": 2}
    assert folders.assign([{}, {}]) == {}


@pytest.mark.parametrize(
    ("env", "node", "leader"),
    [
        ({"RANK": "5", "LOCAL_RANK": "1"}, 4, False),  # torchrun: node of ranks 4.., not its fetcher
        ({"RANK": "4", "LOCAL_RANK": "0"}, 4, True),
        ({"RANK": "3"}, 3, True),  # no launcher named the node: a node of its own, fetching for itself
    ],
)
def test_a_rank_knows_its_node_and_whether_it_fetches_for_it(monkeypatch, env, node, leader):
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert folders.node_rank() == node and folders.is_node_leader() is leader


@pytest.mark.slow
def test_folders_of_two_ranks_commit_as_one_checkpoint_fail_together_and_fetch_verified(tmp_path):
    root = tmp_path / "ckpt"
    cmd = [sys.executable, str(WORKERS / "dist_folders.py"), str(root), str(tmp_path)]
    for r, done in enumerate(run_ranks(cmd, timeout=120)):
        assert done.returncode == 0, f"rank {r}: {done.stderr[-3000:]}"
    by = {(rec["rank"], rec["case"], rec.get("step")): rec for rec in worker_results(tmp_path)}
    for rank in (0, 1):
        commit = by[(rank, "commit", 2)]
        assert commit["files"] == ["shared.bin", "sub/own-0.bin", "sub/own-1.bin"] and commit["world"] == 2
        failed = by[(rank, "failing-rank", None)]
        assert failed["kind"] == "ConfigError" and "rank 1" in failed["message"], failed
        fetched = by[(rank, "fetch", 1)]  # step 2 fails its checksum: both skip to step 1 together
        assert fetched["files"] == ["shared.bin", "sub/own-0.bin", "sub/own-1.bin"] and fetched["shared"] == 1
        # A node of its own: the shared file and its own rank's, never the other rank's; rank 1's
        # corrupt file of step 2 is seen by node 1 alone, and node 0 skips step 2 with it.
        assert by[(rank, "per-node", 1)]["files"] == ["shared.bin", f"sub/own-{rank}.bin"]
        # Rank 0 marked step 2 corrupt each time (a second read confirmed it), whichever node had seen it.
        assert by[(0, "marked-after-fetch", None)]["marked"] and by[(0, "marked-after-per-node", None)]["marked"]
        planned = by[(rank, "planned", 1)]  # step 2 was planned, step 1 verified: moved to step 2's place
        assert planned["files"] == ["shared.bin", f"sub/own-{rank}.bin"] and planned["shared"] == 1, planned
        assert by[(rank, "planned-removed", None)]["gone"] is True
        assert by[(rank, "resharded", 4)]["files"] == ["shared.bin", "sub/own-0.bin", "sub/own-1.bin"]
        # Both revisions are there (folders.commit does not prune): the fetch took the newer one's files.
        superseded = by[(rank, "supersede", 1)]
        assert superseded["names"] == ["step-00000001", "step-00000001.r1"] and superseded["shared"] == 11
        assert by[(rank, "none-loads", None)] == {
            "rank": rank,
            "case": "none-loads",
            "kind": "NoLoadableCheckpointError",
            "skipped": 2,
        }
    complete = sorted(i.step for i in scan(open_storage(str(root))) if i.complete)
    assert 3 not in complete  # the failing rank left no manifest
