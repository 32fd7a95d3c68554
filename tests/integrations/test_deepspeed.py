"""DeepSpeed + DeepSpeedGuard under torchrun on CPU (gloo): a notice on rank 1 only stops both ranks after
the same step with one committed emergency checkpoint, and the resumed job equals an uninterrupted one
bit for bit (every step's loss, and the final weights). ZeRO-2 on one node of 2 ranks, ZeRO-3 on 2
"nodes" of 1 rank (separate torchrun agents, a c10d rendezvous on 127.0.0.1, local folders per node:
nothing shared but the storage), with tests/integrations/groups.py's story. Stages 0 and 1 save, and a
fresh engine resumes, in one job (tests/workers/deepspeed_stages.py, which also runs the references:
each torchrun launch costs ~20 s here).

The first DeepSpeed job on a machine JIT-builds a small C++ op (minutes on 2 busy cores); later ones
reuse it from ~/.cache/torch_extensions.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest

from spotguard.checkpoint import scan
from spotguard.storage import open_storage
from tests.helpers import WORKERS, read_losses, run, subprocess_env, torchrun, worker_results

from . import groups

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torchdata") is None:
    pytest.skip("needs deepspeed and torchdata: pip install 'spotguard[deepspeed,data]'", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = "deepspeed_train.py"
STEPS, EVERY = 40, 15
# 16 batches per rank and epoch: the run crosses two epoch ends; periodic checkpoints every 15 steps.
ARGS = ("--steps", str(STEPS), "--every-steps", str(EVERY), "--interval", "0.2", "--providers", "signal,file")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    with groups.forked_ranks(SCRIPT):
        yield


def job(run_dir: Path, stage: int, nodes: int, nproc: int) -> groups.Job:
    """The example's job; each node fetches a resume's copy into a folder of its own (``--work-dir``)."""
    args = (*ARGS, "--zero-stage", str(stage))
    return groups.Job(
        SCRIPT, run_dir, args, nodes=nodes, nproc=nproc, local_args=lambda node: ("--work-dir", str(node / "work"))
    )


def reference(launch: Path, stage: int) -> tuple[list[tuple[int, float]], Path]:
    """Rank 0's losses and the final weights of the uninterrupted run of ``stage`` (as ``groups.reference``)."""
    return read_losses(launch / f"zero{stage}" / "loss-0.jsonl"), launch / f"zero{stage}" / "final.pt"


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Path:
    """One torchrun launch (each costs ~20 s here): the uninterrupted ZeRO-2 and ZeRO-3 reference runs
    (``zero<N>/loss-{rank}.jsonl``, ``zero<N>/final.pt``), stages 0 and 1 saved and resumed, a first
    save refused for state that would not load, and resumes refused for saved state nothing restores and for a
    loader of another batch size."""
    out = tmp_path_factory.mktemp("deepspeed-references")
    worker = WORKERS / "deepspeed_stages.py"
    jobs = ("--resume", "0", "1", "--reference", "2", "3", "--steps", str(STEPS), "--every-steps", str(EVERY))
    cmd = torchrun(2, worker, str(out), *jobs, "--refuse", "--untracked", "--rebatch")
    done = run(cmd, env=subprocess_env(), timeout=600)  # the first DeepSpeed job on a machine compiles its op
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def assert_written_by_both_ranks(stop: int, names: set[str]) -> None:
    assert {f"step{stop}/spotguard-rank0.pt", f"step{stop}/spotguard-rank1.pt"} <= names, names
    assert sum("optim_states" in name for name in names) == 2, names  # one optimizer partition per rank


def test_zero2_notice_on_one_rank_stops_both_and_resume_is_exact(tmp_path, launch):
    stop, names = groups.stop_one_rank_then_finish(job(tmp_path, 2, 1, 2), STEPS, reference(launch, 2), _rng)
    assert_written_by_both_ranks(stop, names)


def test_zero3_on_two_nodes_with_local_folders_stops_both_and_resume_is_exact(tmp_path, launch):
    two_nodes = job(tmp_path, 3, 2, 1)
    stop, names = groups.stop_one_rank_then_finish(two_nodes, STEPS, reference(launch, 3), _rng, quiet=False)
    assert_written_by_both_ranks(stop, names)
    assert {f"step{stop}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= names  # ZeRO-3: per rank

    def own(rank: int) -> set[str]:  # DeepSpeed 0.19 reads only its own ZeRO partition (no elastic checkpoint)
        zero = f"step{stop}/zero_pp_rank_{rank}_mp_rank_00"
        return {f"{zero}_optim_states.pt", f"{zero}_model_states.pt", f"step{stop}/spotguard-rank{rank}.pt"}

    groups.assert_each_node_left_out_the_others(two_nodes.resumed, stop, own)
    for node in (0, 1):  # each node fetched its copy into its own folder, removed once both ranks had loaded
        work = tmp_path / f"node{node}" / "work"
        private = work / f"spotguard-{os.geteuid()}"  # this user's folder of node copies (0700) stays, empty
        assert work.is_dir() and list(work.iterdir()) == [private] and not any(private.iterdir()), node


def test_zero_stages_0_and_1_resume_a_fresh_engine_exactly(launch):
    results = [r for r in worker_results(launch) if "resumed" in r]
    assert sorted((r["rank"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["resumed"] == 12, r
        assert len(r["first"]) == 20 and r["second"] == r["first"][12:], r  # steps 13..20, bit for bit
        assert r["weights_same"], r


def test_first_save_refuses_state_that_would_not_load_on_any_rank(launch):
    # Rank 1 alone tracks DeepSpeed's LossScaler (pickled, refused by torch.load(weights_only=True)): the
    # save fails on both ranks at once, naming the object, and nothing is committed that the resume would skip.
    refused = {r["rank"]: r["refused"] for r in worker_results(launch) if "refused" in r}
    for rank in (0, 1):  # both name rank 1's object and its class, and no other rank
        text = refused[rank]
        assert text.startswith("UnloadableStateError: the checkpoint of step 1 cannot be written: rank 1: "), refused
        assert "tracked object 'scaler'" in text and "LossScaler" in text and "rank 0" not in text, refused
    assert scan(open_storage(str(launch / "refused"))) == []


def test_a_resume_that_would_drop_the_saved_scheduler_and_loader_is_refused_on_every_rank(launch):
    # DeepSpeed's load_checkpoint skips a saved lr_scheduler the engine lacks without a word.
    results = {r["rank"]: r for r in worker_results(launch) if "untracked" in r}
    for rank in (0, 1):
        text = results[rank]["untracked"]
        assert text.startswith("CheckpointMismatchError: the checkpoint of step 12 cannot be loaded: rank 0: "), text
        assert "holds the state of engine.lr_scheduler, loader, which nothing tracks now" in text, text
        assert results[rank]["accepted"] == 12  # untracked="accept": resumed without them


def test_a_resume_with_another_batch_size_is_refused_on_every_rank_unless_accepted(launch):
    # As for Guard (data.check_loaders): the checkpoint records the tracked loader's batch size.
    results = {r["rank"]: r for r in worker_results(launch) if "rebatch" in r}
    for rank in (0, 1):
        text = results[rank]["rebatch"]
        assert text.startswith("CheckpointMismatchError: the checkpoint of step 12 cannot be loaded: rank 0: "), text
        assert "'loader' was saved with batch_size=8 and has batch_size=4 now" in text, text
        assert results[rank]["rebatch_accepted"] == 12
