"""Done-when of the cloud notices: on each cloud, a mock metadata server and ``simulate-preemption``
drive the real example to an emergency checkpoint, and the restarted run resumes exactly."""

from __future__ import annotations

import random

import pytest

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.ops.cli import main as spotguard_main
from spotguard.ops.mockmeta import endpoint_env
from spotguard.storage import open_storage

from .forked import installed
from .helpers import (
    EXAMPLE,
    after_step,
    assert_same_run,
    example_cmd,
    read_losses,
    run_example,
    stop_when,
    subprocess_env,
)

pytestmark = pytest.mark.slow

ARGS = ("--steps", "60", "--every-steps", "25", "--batch-size", "16", "--num-workers", "0")
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with installed(EXAMPLE):  # the example's runs fork from one server: one Python start, one import torch
        yield


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_simulated_cloud_preemption_checkpoints_and_resumes_identically(
    tmp_path, reference_runs, mock_metadata, cloud, capsys
):
    reference = reference_runs(*ARGS)
    server = mock_metadata(cloud)
    env = subprocess_env(**endpoint_env(cloud, server.url))
    storage, losses, final = tmp_path / "ckpt", tmp_path / "losses.jsonl", tmp_path / "final.pt"
    at = _rng.randint(3, 35)

    def preempt(_) -> None:
        assert spotguard_main(["simulate-preemption", "--cloud", cloud, "--endpoint", server.url]) == 0

    first = stop_when(
        example_cmd(
            storage, *ARGS, "--providers", cloud, "--interval", "0.2", "--losses", str(losses), "--step-sleep", "0.03"
        ),
        after_step(losses, at),
        preempt,
        env=env,
    )
    assert first.returncode == EXIT_PREEMPTED, (at, first.stdout, first.stderr)
    assert f"notice from {cloud}" in first.stdout
    stopped = read_losses(losses)[-1][0]
    assert at <= stopped < 60
    (info,) = [i for i in scan(open_storage(str(storage))) if i.step == stopped]
    assert info.complete and info.manifest.reason in ("emergency", "periodic")
    if cloud == "azure":  # the eviction was approved once the checkpoint was safe
        assert server.mock.acks == [server.mock.events[0]["EventId"]]

    assert spotguard_main(["simulate-preemption", "--clear", "--endpoint", server.url]) == 0
    capsys.readouterr()
    second = run_example(
        storage,
        *ARGS,
        "--providers",
        cloud,
        "--interval",
        "0.2",
        "--losses",
        str(losses),
        "--final",
        str(final),
        env=env,
    )
    assert second.returncode == 0, second.stderr
    assert f"resuming at step {stopped}" in second.stdout
    assert_same_run(losses, final, reference)
