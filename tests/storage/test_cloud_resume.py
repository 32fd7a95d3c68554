"""The exact-resume promise on the cloud backends, s3:// (moto server), gs:// (fake-gcs-server: it
enforces the manifest's if_generation_match, as GCS does) and az:// (Azurite): examples/train.py stopped by SIGTERM at a
random step, resumed, and compared bit for bit with an uninterrupted run; a sharded checkpoint of two
ranks saved and resumed exactly."""

from __future__ import annotations

import random
import signal

import pytest
import torch

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import latest, scan
from spotguard.storage import open_storage
from tests.helpers import (
    EXAMPLE_ARGS,
    WORKERS,
    after_step,
    assert_same,
    assert_same_run,
    example_cmd,
    read_losses,
    run,
    run_example,
    signal_to,
    stop_when,
    subprocess_env,
    torchrun,
)
from tests.storage.conftest import AWS_ENV, azurite_connection

pytestmark = pytest.mark.slow
_rng = random.Random()


@pytest.fixture(params=["s3", "gs", "az"])
def cloud(request):
    """(url, environment for the child processes) for each cloud backend."""
    if request.param == "s3":
        url = request.getfixturevalue("s3_url")
        return url, subprocess_env(**AWS_ENV, AWS_ENDPOINT_URL=request.getfixturevalue("moto").url)
    if request.param == "az":
        url = request.getfixturevalue("az_url")
        return url, subprocess_env(AZURE_STORAGE_CONNECTION_STRING=azurite_connection(request.getfixturevalue("azurite").port))
    url = request.getfixturevalue("fake_gcs_url")
    return url, subprocess_env(STORAGE_EMULATOR_HOST=request.getfixturevalue("fake_gcs").url)


def test_resume_from_cloud_storage_continues_identically(tmp_path, reference_runs, cloud):
    url, env = cloud
    args = (*EXAMPLE_ARGS, "--num-workers", "0")
    reference = reference_runs(*args)
    at = _rng.randint(3, 80)
    losses, final = tmp_path / "losses.jsonl", tmp_path / "final.pt"
    first = stop_when(example_cmd(url, *args, "--losses", str(losses), "--step-sleep", "0.03"), after_step(losses, at),
                      signal_to(signal.SIGTERM), env=env)
    assert first.returncode == EXIT_PREEMPTED, (at, first.stdout, first.stderr)
    stopped = read_losses(losses)[-1][0]
    assert [i.step for i in scan(open_storage(url)) if i.complete][-1] == stopped

    second = run_example(url, *args, "--losses", str(losses), "--final", str(final), env=env)
    assert second.returncode == 0, second.stderr
    assert f"resuming at step {stopped}" in second.stdout
    assert_same_run(losses, final, reference)


def test_sharded_checkpoint_of_two_ranks_resumes_exactly_from_cloud_storage(tmp_path, cloud):
    url, env = cloud
    done = run(torchrun(2, WORKERS / "dist_cloud_roundtrip.py", url, str(tmp_path)), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    info = latest(open_storage(url))
    assert info and info.step == 3 and info.manifest and info.manifest.world_size == 2
    assert {f.name for f in info.manifest.files} == {"rank-00000.pt", "rank-00001.pt", "shards/metadata.dcp",
                                                     "shards/rank-00000.distcp", "shards/rank-00001.distcp"}
    for rank in (0, 1):
        assert_same(torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=True),
                    torch.load(tmp_path / f"saved-{rank}.pt", weights_only=True), f"rank {rank}")
