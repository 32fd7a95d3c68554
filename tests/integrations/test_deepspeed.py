"""DeepSpeed + DeepSpeedGuard under torchrun on CPU (gloo): a notice on rank 1 only stops both ranks after
the same step with one committed emergency checkpoint, and the resumed job equals an uninterrupted one
bit for bit (every step's loss on every rank, and the final weights). ZeRO-2 on one node of 2 ranks,
ZeRO-3 on 2 "nodes" of 1 rank (separate torchrun agents, a c10d rendezvous on 127.0.0.1, a local folder
per node: nothing shared but the storage). Stages 0 and 1 save, and a fresh engine resumes, in one job
(tests/workers/deepspeed_stages.py, which also runs the references: each torchrun launch costs ~20 s).

The first DeepSpeed job on a machine JIT-builds a small C++ op (minutes on 2 busy cores); later ones
reuse it from ~/.cache/torch_extensions.
"""

from __future__ import annotations

import importlib.util
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import latest, scan
from spotguard.storage import open_storage
from tests.helpers import (
    REPO,
    WORKERS,
    after_step,
    assert_same,
    free_port,
    last_step,
    read_losses,
    run,
    stop_when,
    stopped_for_notice,
    subprocess_env,
    torchrun,
    worker_results,
)

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torchdata") is None:
    pytest.skip("needs deepspeed and torchdata: pip install 'spotguard[deepspeed,data]'", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = REPO / "examples" / "deepspeed_train.py"
STEPS, EVERY = 40, 15
# 16 batches per rank and epoch: the run crosses two epoch ends; periodic checkpoints every 15 steps.
ARGS = (
    "--steps",
    str(STEPS),
    "--every-steps",
    str(EVERY),
    "--interval",
    "0.2",
    "--providers",
    "signal,file",
    "--quiet",
)
_rng = random.Random()


def env(run_dir: Path) -> dict[str, str]:
    """Each rank watches its own notice file: ``notice-1`` is a notice to rank 1 only."""
    return subprocess_env(DS_ACCELERATOR="cpu", SPOTGUARD_NOTICE_FILE=str(run_dir / "notice-{rank}"))


def job_args(run_dir: Path, stage: int, *args: str) -> tuple[str, ...]:
    return (
        "--storage",
        str(run_dir / "ckpt"),
        "--losses",
        str(run_dir / "loss-{rank}.jsonl"),
        "--zero-stage",
        str(stage),
        *ARGS,
        *args,
    )


def node_cmd(port: int, job: str, *args: str) -> list[str]:
    """One node's torchrun: 1 worker, joining a 2-node job at the c10d store on 127.0.0.1:port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        job,
        "--local-addr",
        "127.0.0.1",
        str(EXAMPLE),
        *args,
    ]


def run_job(
    run_dir: Path, stage: int, *args: str, nodes: int = 1, stop_at: int | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """The example's 2 ranks, as one torchrun or as 2 nodes (each with its own ``node<N>`` work folder);
    with ``stop_at``, a notice to rank 1 once it has logged that step."""
    full = job_args(run_dir, stage, *args, *(("--step-sleep", "0.05") if stop_at is not None else ()))

    def notice(_: object) -> None:
        (run_dir / "notice-1").write_text("{}")

    ready = after_step(run_dir / "loss-1.jsonl", stop_at or 0)
    if nodes == 1:
        cmd = torchrun(2, EXAMPLE, *full)
        return [run(cmd, env=env(run_dir)) if stop_at is None else stop_when(cmd, ready, notice, env=env(run_dir))]
    port, job = free_port(), f"job-{_rng.randrange(1 << 30)}"
    cmd = node_cmd(port, job, *full, "--work-dir", str(run_dir / "node{rank}"))
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(run, cmd, env=env(run_dir))
        first = run(cmd, env=env(run_dir)) if stop_at is None else stop_when(cmd, ready, notice, env=env(run_dir))
        return [first, other.result()]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Path:
    """One torchrun launch (each costs ~20 s here): the uninterrupted ZeRO-2 and ZeRO-3 reference runs
    (``zero<N>/loss-{rank}.jsonl``, ``zero<N>/final.pt``), stages 0 and 1 saved and resumed, and a first
    save refused for state that would not load."""
    out = tmp_path_factory.mktemp("deepspeed-references")
    worker = WORKERS / "deepspeed_stages.py"
    jobs = ("--resume", "0", "1", "--reference", "2", "3", "--steps", str(STEPS), "--every-steps", str(EVERY))
    cmd = torchrun(2, worker, str(out), *jobs, "--refuse")
    done = run(cmd, env=env(out), timeout=600)  # the first DeepSpeed job on a machine compiles its op
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def stop_on_rank1_then_resume(run_dir: Path, stage: int, ref: Path, nodes: int) -> int:
    at = _rng.randint(4, 25)
    first = run_job(run_dir, stage, nodes=nodes, stop_at=at)
    out = "".join(p.stdout for p in first)
    for proc in first:
        assert stopped_for_notice(proc), (at, proc.returncode, proc.stderr[-4000:])
    stops = [last_step(run_dir / f"loss-{r}.jsonl") for r in range(2)]
    stop = stops[0]
    assert stop is not None and stops[1] == stop and at <= stop < STEPS, (at, stops)
    # Both ranks chose to exit 75 after the same step; rank 0 saw no notice itself: it heard of rank 1's.
    assert f"rank 0 of 2 stopped at step {stop} (preempt notice from peer); exiting {EXIT_PREEMPTED}" in out, out
    assert f"rank 1 of 2 stopped at step {stop} (file notice from file); exiting {EXIT_PREEMPTED}" in out, out
    info = latest(open_storage(str(run_dir / "ckpt")))
    again = any(re.search(rf"at step {stop}: already checkpointed", p.stderr) for p in first)
    assert info is not None and info.step == stop and info.manifest is not None, info
    assert info.manifest.reason in ({"emergency", "periodic"} if again else {"emergency"}), info.manifest.reason
    assert info.manifest.world_size == 2
    files = {f.name for f in info.manifest.files}
    assert {f"step{stop}/spotguard-rank0.pt", f"step{stop}/spotguard-rank1.pt"} <= files, files
    assert sum("optim_states" in name for name in files) == 2, files  # one optimizer shard per rank

    (run_dir / "notice-1").unlink()
    second = run_job(run_dir, stage, "--final", str(run_dir / "final.pt"), nodes=nodes)
    for proc in second:
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"ZeRO-{stage}, starting at step {stop}" in "".join(p.stdout for p in second)
    for r in range(2):
        got, want = read_losses(run_dir / f"loss-{r}.jsonl"), dict(read_losses(ref / f"loss-{r}.jsonl"))
        for step, loss in got:  # steps replayed after the stop equal the reference too
            assert loss == want[step], (r, step, loss, want[step])
        assert sorted(dict(got)) == sorted(want)
    assert_same(torch.load(run_dir / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True))
    return stop


def test_zero2_notice_on_one_rank_stops_both_and_resume_is_exact(tmp_path, launch):
    stop_on_rank1_then_resume(tmp_path, 2, launch / "zero2", nodes=1)


def test_zero3_on_two_nodes_with_local_folders_stops_both_and_resume_is_exact(tmp_path, launch):
    stop_on_rank1_then_resume(tmp_path, 3, launch / "zero3", nodes=2)
    # each node fetched its own copy into its own folder, and removed it once both ranks had loaded
    for node in (0, 1):
        assert (tmp_path / f"node{node}").is_dir() and not any((tmp_path / f"node{node}").iterdir())


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
