"""A notice whose deadline is already past never stops the emergency save before it starts (issue 17).

Against real S3 (moto) and GCS (the emulator) through the real SDKs: a spot notice with a stale
``time`` (the AWS Node Termination Handler's fixtures carry 2017 dates), and a notice whose deadline
has passed by the time the step ends, both end with a committed emergency checkpoint.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
import torch

import spotguard
from spotguard.checkpoint import scan
from spotguard.notices.aws import AwsProvider
from spotguard.storage import open_storage


@pytest.fixture(params=["s3", "gs"])
def cloud_url(request):
    return request.getfixturevalue("s3_url" if request.param == "s3" else "gcp_emulator_url")


def run(url: str, providers, notify=None, steps: int = 300) -> tuple[spotguard.Guard, int | None]:
    model = torch.nn.Linear(4, 4)
    guard = spotguard.Guard(url, providers=providers, interval=0.05, save_on_exit=False)
    guard.track(model=model)
    with guard:
        for step in range(1, steps):
            if step == 3 and notify is not None:
                notify(guard)
            time.sleep(0.01)
            if guard.step(step):
                return guard, step
    return guard, None


def committed(url: str) -> list[tuple[int, str]]:
    return [(i.step, i.manifest.reason) for i in scan(open_storage(url)) if i.complete]


def test_a_stale_spot_time_still_gets_its_emergency_checkpoint(mock_metadata, cloud_url):
    server = mock_metadata("aws")
    guard, stopped = run(
        cloud_url,
        [AwsProvider(server.url)],
        lambda g: server.mock.values.__setitem__(
            "spot/instance-action", json.dumps({"action": "terminate", "time": "2017-09-18T08:22:00Z"})
        ),
    )
    assert stopped is not None and guard.emergency_error is None, guard.emergency_error
    assert (stopped, "emergency") in committed(cloud_url)


def test_a_deadline_that_passed_before_the_step_ended_gets_a_best_effort_save(cloud_url, caplog):
    passed = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=30)  # e.g. a step longer than the notice
    guard, stopped = run(
        cloud_url,
        None,
        lambda g: g.watcher.report(
            spotguard.Notice("file", "file", deadline=passed, raw={"deadline": passed.isoformat()})
        ),
    )
    assert stopped is not None and guard.emergency_error is None, guard.emergency_error
    assert (stopped, "emergency") in committed(cloud_url)
    assert "best effort" in caplog.text
