"""Two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1), each with its own mock cloud
metadata server: a spot notice on one node's metadata stops every rank of both after the same step,
and the resumed job continues exactly as an uninterrupted one.

One worker per node (world size 2), to share the 2-rank reference run. With 3+ ranks a resume was
once off in the last bits of the loss (2.07314134 vs 2.07314110): a fresh DDP reduced the first
step's gradients in another bucket layout than the one it rebuilt after step 1, so gloo added the
ranks' values in another order. ``resume()`` now pins the layout (spotguard.guard.buckets);
tests/guard/test_ddp_buckets.py checks 4 ranks resume bit for bit."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from spotguard.checkpoint import latest
from spotguard.ops.cli import main as spotguard_main
from spotguard.ops.mockmeta import endpoint_env
from spotguard.storage import open_storage
from tests.forked import behind, launched
from tests.helpers import (
    DDP_ARGS,
    EXAMPLE_DDP,
    after_step,
    assert_same,
    free_port,
    read_losses,
    run,
    stop_when,
    stopped_for_notice,
    subprocess_env,
)

pytestmark = pytest.mark.slow

ARGS = (*DDP_ARGS, "--quiet", "--interval", "0.2", "--providers", "aws")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def ranks():
    """The nodes' ranks forked from one server that imported the example (tests/forked.py ``behind``)."""
    with behind(EXAMPLE_DDP):
        yield


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
        *launched(EXAMPLE_DDP),
        *args,
    ]


def run_nodes(
    tmp: Path, servers, storage: Path, *args: str, losses: str, act_at: int | None = None, act=None
) -> list[subprocess.CompletedProcess[str]]:
    """Start both nodes (node i reads servers[i]'s metadata); at step ``act_at`` of rank 0 call ``act()``."""
    port, job = free_port(), f"job-{_rng.randrange(1 << 30)}"
    cmd = node_cmd(port, job, "--storage", str(storage), *ARGS, "--losses", losses, *args)
    envs = [subprocess_env(**endpoint_env("aws", server.url)) for server in servers]
    if act is None:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda env: run(cmd, env=env), envs))
    # Node 1 starts first (in a thread, run to its end); node 0 is the one watched and acted upon.
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(run, cmd, env=envs[1])
        first = stop_when(cmd, after_step(tmp / "loss-0.jsonl", act_at), lambda _: act(), env=envs[0])
        return [first, other.result()]


def test_spot_notice_on_one_node_stops_both_nodes_on_one_step_and_resume_is_exact(
    tmp_path, mock_metadata, ddp_reference
):
    ref = ddp_reference  # 2 ranks on one node: the same losses, bit for bit

    servers = [mock_metadata("aws"), mock_metadata("aws")]
    storage, losses, at = tmp_path / "ckpt", str(tmp_path / "loss-{rank}.jsonl"), _rng.randint(4, 25)
    first = run_nodes(
        tmp_path,
        servers,
        storage,
        "--step-sleep",
        "0.05",
        losses=losses,
        act_at=at,
        act=lambda: spotguard_main(["simulate-preemption", "--cloud", "aws", "--endpoint", servers[1].url]),
    )
    for node in first:
        assert stopped_for_notice(node), (at, node.stderr[-3000:])
    stops = [read_losses(tmp_path / f"loss-{r}.jsonl")[-1][0] for r in range(2)]
    assert len(set(stops)) == 1 and at <= stops[0] < 40, (at, stops)
    info = latest(open_storage(str(storage)))
    assert info and info.step == stops[0] and info.manifest.reason == "emergency" and info.manifest.world_size == 2
    said = "".join(node.stdout for node in first)
    assert f"all 2 ranks stopped at step {stops[0]} (" in said, said

    assert spotguard_main(["simulate-preemption", "--clear", "--endpoint", servers[1].url]) == 0
    second = run_nodes(tmp_path, servers, storage, "--final", str(tmp_path / "final.pt"), losses=losses)
    for node in second:
        assert node.returncode == 0, node.stderr[-3000:]
    assert any(f"resuming at step {stops[0]}" in node.stdout for node in second)
    for r in range(2):
        got, want = read_losses(tmp_path / f"loss-{r}.jsonl"), dict(read_losses(ref / f"loss-{r}.jsonl"))
        for step, loss in got:  # steps replayed after the stop equal the reference too
            assert loss == want[step], (r, step)
        assert sorted(dict(got)) == sorted(want)
    assert_same(torch.load(tmp_path / "final.pt", weights_only=True), torch.load(ref / "final.pt", weights_only=True))
