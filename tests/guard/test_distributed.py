"""Distributed training with real processes on gloo: same-step stops, exact resume, resharding.

Each torchrun start costs seconds, so each test launches few jobs and checks several things. Where the
launcher is not what a test checks (a resume, a worker's own protocol) the ranks run around a store the
test holds (``run_group``, ``run_ranks``), each forked from one server that imported torch once.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spotguard import CheckpointMismatchError, Guard
from spotguard.checkpoint import latest, scan
from spotguard.checkpoint.sharded.dcp import load_metadata
from spotguard.ops.rehearsal.compare import compare
from spotguard.storage import open_storage
from tests.forked import PRELOAD, behind
from tests.helpers import (
    DDP_ARGS,
    EXAMPLE_DDP,
    WORKERS,
    after_step,
    assert_same,
    ddp_example_cmd,
    read_losses,
    run_group,
    run_ranks,
    stop_when,
    stopped_for_notice,
    subprocess_env,
    torchrun,
    worker_results,
)

_rng = random.Random()  # the test's own randomness

#: Scripts whose runs here, and whose ranks under torchrun, fork from one server (tests/forked.py).
FORKED = (
    EXAMPLE_DDP,
    *(WORKERS / f"dist_{name}.py" for name in ("reshard", "one_rank_fails", "fsdp2", "async_save", "destroy_inflight")),
)
#: What their ranks import on top of PRELOAD (DDP's constructor imports dynamo: seconds per process).
HEAVY = (
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "spotguard.checkpoint.sharded.sharded",
)


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with behind(*FORKED, preload=(*PRELOAD, *HEAVY)):  # torchrun's ranks of them too
        yield


def ddp_group(storage: Path, *args: str, script: Path = EXAMPLE_DDP) -> subprocess.CompletedProcess[str]:
    """examples/train_ddp.py (or a worker taking its arguments) as 2 ranks around a store held here, as
    ``ddp_example_cmd`` runs it under torchrun: every rank must exit 0; rank 0's output, then rank 1's."""
    cmd = [sys.executable, str(script), "--storage", str(storage), "--quiet", "--interval", "0.2", *args]
    done = run_group(cmd)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    return subprocess.CompletedProcess(cmd, 0, "".join(d.stdout for d in done), "".join(d.stderr for d in done))


def worker_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of one rank among torchrun's children (read from their environment)."""
    for child in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no rank {rank} among the children of {torchrun_pid}")


def last_steps(tmp: Path, pattern: str, ranks: int) -> list[int]:
    return [read_losses(tmp / pattern.format(rank=r))[-1][0] for r in range(ranks)]


@pytest.mark.slow
def test_notice_on_one_rank_stops_all_ranks_on_one_step_and_resume_is_identical(tmp_path, ddp_reference):
    common, ref = DDP_ARGS, ddp_reference

    at = _rng.randint(4, 28)
    notice = tmp_path / "notice-{rank}"
    losses = str(tmp_path / "loss-{rank}.jsonl")
    storage = tmp_path / "ckpt"
    # Polling every 0.2 s at ~18 steps/s: the notice (written at step `at` <= 28) is seen well
    # before step 40 whatever the moment of the polling cycle (at 1 s it could be missed).
    first = stop_when(
        ddp_example_cmd(2, storage, *common, "--losses", losses, "--step-sleep", "0.05"),
        after_step(tmp_path / "loss-0.jsonl", at),
        lambda _: Path(str(notice).format(rank=1)).write_text('{"deadline_in": 20}'),
        env=subprocess_env(SPOTGUARD_NOTICE_FILE=str(notice)),
    )
    assert stopped_for_notice(first), (at, first.stdout, first.stderr[-3000:])
    stops = last_steps(tmp_path, "loss-{rank}.jsonl", 2)
    assert stops[0] == stops[1] and at <= stops[0] < 40, (at, stops)
    for r in range(2):  # rank 0 saw no notice, yet its emergency save ran against rank 1's deadline
        left = re.search(
            rf"\[rank {r}\] spotguard.guard.stop: emergency checkpoint of step {stops[0]} "
            rf"committed in [0-9.]+s, T-([0-9.]+)s before the deadline",
            first.stderr,
        )
        assert left and 0 < float(left.group(1)) <= 20, (r, first.stderr[-3000:])
    info = latest(open_storage(str(storage)))
    assert info and info.step == stops[0] and info.manifest and info.manifest.world_size == 2
    assert info.manifest.reason == "emergency"
    names = {f.name for f in info.manifest.files}
    assert {"rank-00000.pt", "rank-00001.pt", "shards/metadata.dcp"} <= names

    Path(str(notice).format(rank=1)).unlink()
    second = ddp_group(storage, *common, "--losses", losses, "--final", str(tmp_path / "final.pt"))
    assert f"resuming at step {stops[0]}" in second.stdout
    for r in range(2):
        got, want = read_losses(tmp_path / f"loss-{r}.jsonl"), dict(read_losses(ref / f"loss-{r}.jsonl"))
        for step, loss in got:  # steps replayed after the stop equal the reference too
            assert loss == want[step], (r, step)
        assert sorted(dict(got)) == sorted(want)
    assert_same(torch.load(tmp_path / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True))
    # The final sharded checkpoints, as `spotguard rehearse --reference` compares them: DCP shards and rank files.
    same = compare(str(storage), str(ref / "ckpt"))
    assert same.exact and not same.skipped, same.line()
    assert same.compared > len(torch.load(ref / "final.pt", weights_only=True)) * 3, same.line()  # model, Adam's 2


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_sigusr1_to_one_of_four_ranks_then_reshard_to_two(tmp_path, single_rank_group):
    storage, losses = tmp_path / "ckpt", str(tmp_path / "loss4-{rank}.jsonl")
    four = stop_when(
        ddp_example_cmd(
            4,
            storage,
            "--steps",
            "200",
            "--every-steps",
            "0",
            "--step-sleep",
            "0.05",
            "--losses",
            losses,
            "--final",
            str(tmp_path / "at-stop.pt"),
        ),
        after_step(tmp_path / "loss4-0.jsonl", _rng.randint(3, 8)),
        lambda proc: os.kill(worker_pid(proc.pid, 2), signal.SIGUSR1),
    )
    assert stopped_for_notice(four), four.stderr[-3000:]
    stops = last_steps(tmp_path, "loss4-{rank}.jsonl", 4)
    assert len(set(stops)) == 1, stops
    info = latest(open_storage(str(storage)))
    assert info and info.step == stops[0] and info.manifest.world_size == 4 and info.manifest.reason == "emergency"

    # A different world size is refused for per-rank state (here 1 rank, in this process) ...
    guard = Guard(str(storage), providers=None).track(model=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointMismatchError, match="saved by 4 ranks.*reshard='reset-data'"):
        guard.resume()

    # ... and on 2 ranks too, on every rank, naming the data loader's position; then (same launch)
    # with the opt-in, 2 ranks load exactly the model and optimizer the 4 ranks had.
    two = ddp_group(
        storage, "--steps", str(stops[0]), "--final", str(tmp_path / "resharded.pt"), script=WORKERS / "dist_reshard.py"
    )
    for r in range(2):
        assert re.search(
            rf"^rank {r} refused: .*saved by 4 ranks and this job has 2\..*per-rank state cannot: "
            r"RNG streams and loader.*reshard='reset-data'",
            two.stdout,
            re.M,
        ), two.stdout[-3000:]
    assert f"resuming at step {stops[0]}" in two.stdout
    assert_same(
        torch.load(tmp_path / "resharded.pt", weights_only=True), torch.load(tmp_path / "at-stop.pt", weights_only=True)
    )


@pytest.mark.slow
def test_rank_killed_during_save_leaves_no_committed_checkpoint(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "hanging.pid"
    proc = subprocess.Popen(
        torchrun(2, WORKERS / "dist_blocking_save.py", str(root), str(marker)),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (marker.exists() and (root / "step-00000002" / "rank-00000.pt").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        os.kill(int(marker.read_text()), signal.SIGKILL)  # rank 1 dies mid-save; rank 0 wrote its part
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    infos = {i.step: i for i in scan(open_storage(str(root)))}
    assert infos[1].complete and infos[1].manifest.world_size == 2
    assert infos[2].status == "incomplete", infos[2]
    assert latest(open_storage(str(root))).step == 1


@pytest.mark.slow
def test_storage_failing_on_one_rank_fails_every_rank_at_once(tmp_path):
    """A save or load that fails on rank 1 alone raises there and on rank 0 together; rank 0 used to wait
    in the next collective until the gloo timeout (30 minutes; here the run would be stopped at 90 s)."""
    done = run_group([sys.executable, str(WORKERS / "dist_one_rank_fails.py"), str(tmp_path / "ckpt")], timeout=120)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    got = {(r["case"], r["rank"]): (r["kind"], r["seconds"], r["message"]) for r in worker_results(tmp_path)}
    causes = {
        "save-state": "rank 1: RuntimeError: injected: no state",
        "save-shard": "rank 1: StorageError: injected: cannot write step-00000004/shards/rank-00001.distcp",
        "load-rank-file": "rank 1: StorageError: injected: cannot read step-00000002/rank-00001.pt",
        "load-metadata": "rank 1: StorageError: injected: cannot read step-00000002/shards/metadata.dcp",
        "load-shard": "rank 1: StorageError: injected: cannot read step-00000002/shards/rank-0000",
    }
    for case, cause in causes.items():
        for rank in (0, 1):
            kind, seconds, message = got[case, rank]
            assert kind == "StorageError" and cause in message and seconds < 30, (case, rank, got[case, rank])
    assert got["load-after-all", 0][::2] == got["load-after-all", 1][::2] == ("ok", "2")  # step 2 not skipped


@pytest.mark.slow
def test_fsdp2_checkpoint_of_two_ranks_loads_exactly_on_one(tmp_path, single_rank_group):
    """FSDP2 state is saved without gathering (2 ranks) and resharded onto 1 rank (this process)."""
    from tests.workers.dist_fsdp2 import build, full_state

    done = run_group(
        [sys.executable, str(WORKERS / "dist_fsdp2.py"), str(tmp_path / "ckpt"), str(tmp_path / "full.pt")]
    )
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    meta = load_metadata(tmp_path / "ckpt" / "step-00000003" / "shards" / "metadata.dcp")
    weights = {loc.relative_path for idx, loc in meta.storage_data.items() if idx.fqn.startswith("model.")}
    assert weights == {"rank-00000.distcp", "rank-00001.distcp"}  # each rank wrote its own shards
    model, opt = build()
    guard = Guard(str(tmp_path / "ckpt"), providers=None, reshard="reset-data").track(model=model, optimizer=opt)
    assert guard.resume() == 3
    assert_same(full_state(model, opt), torch.load(tmp_path / "full.pt", weights_only=True))


@pytest.mark.slow
def test_async_sharded_saves_with_a_slow_rank_commit_exactly_the_snapshot_of_their_step(tmp_path):
    """Every step is due, rank 1 writes slowly: both ranks start and skip the same saves (none hangs),
    and every committed checkpoint holds, shard for shard, the state of its own step."""
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from spotguard.checkpoint import open_verified
    from spotguard.checkpoint.sharded.dcp import SpotguardReader

    root = tmp_path / "ckpt"
    steps = 80  # every step due; a save lasts ~20 steps here, more on a loaded machine
    done = run_group([sys.executable, str(WORKERS / "dist_async_save.py"), str(root), str(steps)])
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    lines = worker_results(tmp_path)
    runs = {r["rank"]: r for r in lines if "started" in r}
    resumes = {r["rank"]: r for r in lines if "resumed" in r}
    assert runs[0]["started"] == runs[1]["started"] and runs[0]["skipped"] == runs[1]["skipped"] > 0, runs
    assert len(runs[0]["started"]) >= 2, runs[0]["started"]
    assert resumes[0] == {"rank": 0, "resumed": steps, "exact": True} and resumes[1]["exact"], resumes
    flips = {r["rank"]: r["after_flip"] for r in lines if "after_flip" in r}
    before = max(s for s in runs[0]["started"] if s < steps)  # step steps is the final save, or a periodic one
    assert flips[0] == flips[1] == before, flips  # corrupt step steps skipped on both ranks
    assert "checksum does not match the manifest" in "".join(d.stderr for d in done)

    storage = open_storage(str(root))
    infos = scan(storage)
    periodic = [i for i in infos if i.complete and i.manifest.reason == "periodic"]
    # step `steps` had a shard flipped: the resume that skipped it marked it corrupt (a second read agreed)
    assert [i.status for i in infos if i.step == steps] == ["corrupt"], infos
    assert {i.step for i in periodic} == set(runs[0]["started"]) - {steps}, (periodic, runs[0]["started"])
    for info in periodic:
        for r in range(2):
            with open_verified(storage, info, f"rank-0000{r}.pt") as path:
                assert torch.load(path, weights_only=True)["step"] == info.step
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        sd = {"model": model.state_dict()}
        with SpotguardReader(lambda name, info=info: open_verified(storage, info, name)) as reader:
            dcp.load(sd, storage_reader=reader)
        model.load_state_dict(sd["model"])
        got = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        assert got == runs[0]["states"][str(info.step)], info.step  # the snapshot, not a later state


@pytest.mark.slow
def test_a_background_save_in_flight_when_the_program_destroys_the_group_inside_the_block_still_commits(tmp_path):
    """The background writer coordinates through the store, not a group: destroying every group inside
    the block neither blocks it nor loses it, and the loop paid only the snapshot. Plain processes,
    so that rank 0's process hosts the store: it must outlive rank 1's reading of the outcome."""
    from tests.workers.dist_destroy_inflight import SLOW

    root = tmp_path / "ckpt"
    done = run_ranks([sys.executable, str(WORKERS / "dist_destroy_inflight.py"), str(root), str(tmp_path)], timeout=120)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
        assert "terminate called" not in d.stderr and "stuck" not in d.stderr, d.stderr[-3000:]
    results = {r["rank"]: r for r in worker_results(tmp_path)}
    for r in (0, 1):
        assert results[r]["background"] is True
        assert results[r]["step3_s"] < SLOW / 2, results  # the loop went on while rank 1 wrote
    assert results[1]["close_s"] >= SLOW / 2  # leaving the block waited for the save in flight...
    complete = [(i.step, i.manifest.reason) for i in scan(open_storage(str(root))) if i.complete]
    assert complete == [(3, "periodic")], complete  # ...which committed after the groups were gone
