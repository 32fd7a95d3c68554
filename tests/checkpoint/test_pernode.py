"""Which files one node fetches for a resume (spotguard/checkpoint/pernode.py): pure functions of names."""

from __future__ import annotations

from spotguard.checkpoint import pernode

NAMES = ["model.bin", "own-0", "own-1", "own-2", "own-3", "own-7"]


def own(name: str) -> int | None:
    return int(name[4:]) if name.startswith("own-") else None


def test_a_node_needs_the_shared_files_and_its_own_ranks_files_only():
    assert pernode.needed(NAMES, own, {1}, world=4) == ["model.bin", "own-1", "own-7"]
    assert pernode.needed(NAMES, own, {2, 3}, world=4) == ["model.bin", "own-2", "own-3", "own-7"]


def test_a_rank_the_job_does_not_have_is_a_name_the_rule_does_not_know_and_is_fetched():
    assert "own-7" in pernode.needed(NAMES, own, {0}, world=4)  # rank 7 of 4: fetched, not left out
    assert pernode.needed(NAMES, own, set(range(8)), world=8) == NAMES


def test_every_file_is_fetched_when_the_world_size_changed_or_any_rank_is_unsure():
    assert pernode.why_everything(2, 2, ["", ""]) == ""
    why = pernode.why_everything(4, 2, ["", ""])
    assert "4 ranks" in why and "this job has 2" in why and "resharding" in why
    assert pernode.why_everything(2, 2, ["", "elastic"]) == "elastic"  # one rank's doubt is every node's
    assert pernode.why_everything(2, 2, ["b", "a", "b"]) == "a; b"
