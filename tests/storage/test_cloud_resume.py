"""The exact-resume promise on the cloud backends, s3:// (moto server), gs:// (fake-gcs-server: it
enforces the manifest's if_generation_match, as GCS does) and az:// (Azurite): examples/train.py stopped by SIGTERM at a
random step, resumed, and compared bit for bit with an uninterrupted run; a sharded checkpoint of two
ranks saved and resumed exactly."""

from __future__ import annotations

import random
import signal
import sys

import pytest
import torch

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import latest, scan
from spotguard.storage import open_storage
from tests.forked import installed
from tests.helpers import (
    EXAMPLE,
    EXAMPLE_ARGS,
    WORKERS,
    after_step,
    assert_same,
    assert_same_run,
    example_cmd,
    read_losses,
    run_example,
    run_group,
    signal_to,
    stop_when,
    subprocess_env,
)
from tests.storage.conftest import AWS_ENV, azurite_connection

pytestmark = pytest.mark.slow
_rng = random.Random()


@pytest.fixture(scope="module", autouse=True)
def _forked():
    with installed(EXAMPLE):  # the example's runs fork from one server: one Python start, one import torch
        yield


CLOUDS = ("s3", "gs", "az")


def cloud_url(request: pytest.FixtureRequest, name: str) -> tuple[str, dict[str, str]]:
    """A fresh bucket's URL on one emulated cloud, and what child processes need in their environment for it."""
    if name == "s3":
        return request.getfixturevalue("s3_url"), {**AWS_ENV, "AWS_ENDPOINT_URL": request.getfixturevalue("moto").url}
    if name == "az":
        port = request.getfixturevalue("azurite").port
        return request.getfixturevalue("az_url"), {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection(port)}
    return request.getfixturevalue("fake_gcs_url"), {"STORAGE_EMULATOR_HOST": request.getfixturevalue("fake_gcs").url}


@pytest.fixture(params=CLOUDS)
def cloud(request):
    """(url, environment for the child processes) for each cloud backend."""
    url, env = cloud_url(request, request.param)
    return url, subprocess_env(**env)


def test_resume_from_cloud_storage_continues_identically(tmp_path, reference_runs, cloud):
    url, env = cloud
    args = (*EXAMPLE_ARGS, "--num-workers", "0")
    reference = reference_runs(*args)
    at = _rng.randint(3, 80)
    losses, final = tmp_path / "losses.jsonl", tmp_path / "final.pt"
    first = stop_when(
        example_cmd(url, *args, "--losses", str(losses), "--step-sleep", "0.03"),
        after_step(losses, at),
        signal_to(signal.SIGTERM),
        env=env,
    )
    assert first.returncode == EXIT_PREEMPTED, (at, first.stdout, first.stderr)
    stopped = read_losses(losses)[-1][0]
    assert [i.step for i in scan(open_storage(url)) if i.complete][-1] == stopped

    second = run_example(url, *args, "--losses", str(losses), "--final", str(final), env=env)
    assert second.returncode == 0, second.stderr
    assert f"resuming at step {stopped}" in second.stdout
    assert_same_run(losses, final, reference)


def test_sharded_checkpoint_of_two_ranks_resumes_exactly_from_each_cloud(tmp_path, request):
    """One launch of two ranks (seconds each) for the three clouds, one after the other."""
    urls, env = [], {}
    for name in CLOUDS:
        url, cloud_env = cloud_url(request, name)
        urls.append(url)
        env.update(cloud_env)
    cmd = [sys.executable, str(WORKERS / "dist_cloud_roundtrip.py"), str(tmp_path), *urls]
    for r, d in enumerate(run_group(cmd, env=subprocess_env(**env))):
        assert d.returncode == 0, f"rank {r}: {d.stderr[-3000:]}"
    for i, url in enumerate(urls):
        info = latest(open_storage(url))
        assert info and info.step == 3 and info.manifest and info.manifest.world_size == 2, url
        assert {f.name for f in info.manifest.files} == {
            "rank-00000.pt",
            "rank-00001.pt",
            "shards/metadata.dcp",
            "shards/rank-00000.distcp",
            "shards/rank-00001.distcp",
        }, url
        for rank in (0, 1):
            assert_same(
                torch.load(tmp_path / f"resumed-{i}-{rank}.pt", weights_only=True),
                torch.load(tmp_path / f"saved-{i}-{rank}.pt", weights_only=True),
                f"{url} rank {rank}",
            )
