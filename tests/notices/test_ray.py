"""The `ray` notice source (spotguard.notices.ray) and the Guard's in-step polling of it.

Ray's own call, ``ray.train.get_preemption_info``, needs a Ray Train worker group; it runs for real in
tests/integrations/test_ray_drain.py. Here the source is given a function that answers as Ray does
(a real ``ray.train.PreemptionInfo``), beside a real metadata service (the AWS mock over HTTP).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time

import pytest

import spotguard
from spotguard.checkpoint import scan
from spotguard.errors import ConfigError
from spotguard.guard.insync import InStep
from spotguard.notices.aws import AwsProvider
from spotguard.notices.ray import RayProvider, in_ray_train_worker

ray_train = pytest.importorskip("ray.train")


def _info(seconds_ahead: float | None, ranks: list[int] | None = None):
    ms = None if seconds_ahead is None else int((time.time() + seconds_ahead) * 1000)
    return ray_train.PreemptionInfo(deadline_ms=ms, preempted_node_to_ranks={"node-b": ranks or [1]})


class RayAnswers:
    """Stands in for the barrier call: counts the calls, answers ``info`` once ``after`` calls were made."""

    def __init__(self, info, after: int = 0) -> None:
        self.info, self.after, self.calls = info, after, 0

    def __call__(self):
        self.calls += 1
        return self.info if self.calls > self.after else None


def _ray(answers: RayAnswers) -> RayProvider:
    return RayProvider(get_info=answers, world=lambda: (0, 1))


def test_ray_source_gives_every_rank_a_stop_notice_with_rays_deadline_and_no_thread():
    info = _info(30, ranks=[1])
    notice = _ray(RayAnswers(info)).poll()  # rank 0: its node is not the one draining; it stops all the same
    assert notice is not None and notice.provider == "ray" and notice.kind == "preempt" and not notice.advisory
    assert notice.deadline == dt.datetime.fromtimestamp(info.deadline_ms / 1000, dt.timezone.utc)
    assert notice.raw["preempted_node_to_ranks"] == {"node-b": [1]}
    assert _ray(RayAnswers(_info(None))).poll().deadline is None  # type: ignore[union-attr]
    assert _ray(RayAnswers(None)).poll() is None
    assert _ray(RayAnswers(None)).channels() == []  # never polled by a watcher thread: it is a barrier


def test_ray_source_outside_a_ray_train_worker_is_a_clear_error():
    assert not in_ray_train_worker()
    with pytest.raises(ConfigError, match="inside a Ray Train worker"):
        RayProvider()
    assert "ray" not in spotguard.notices.auto_names()


def test_ray_source_on_several_workers_needs_a_process_group():
    several = RayProvider(get_info=RayAnswers(None), world=lambda: (0, 2))
    with pytest.raises(ConfigError, match="process group"):
        InStep.of([several], 1.0, lambda n: None, distributed=False)
    assert InStep.of([several], 1.0, lambda n: None, distributed=True) is not None


@pytest.mark.slow  # seconds of waiting: in `make test`, not the edit loop's tier
def test_guard_polls_ray_from_step_on_its_interval_and_stops_at_the_step_it_answers(tmp_path):
    answers = RayAnswers(_info(60), after=2)
    guard = spotguard.Guard(str(tmp_path), providers=[_ray(answers)], interval=0.05, every_steps=None, lease_ttl=None)
    stopped = None
    with guard:
        for step in range(1, 1000):
            time.sleep(0.01)
            if guard.step(step):
                stopped = step
                break
    assert stopped is not None and guard.notice is not None and guard.notice.provider == "ray"
    assert answers.calls == 3  # the third call answered; the stop did not ask again (polled at this step)
    assert stopped >= 6  # 50 ms between calls, 10+ ms steps: not one call per step
    (info,) = scan(guard.storage)
    assert info.step == stopped and info.manifest is not None and info.manifest.reason == "emergency"


@pytest.mark.parametrize("ray_first", [True, False])
def test_metadata_and_ray_announcing_one_reclaim_make_one_stop_before_the_earliest_deadline(
    tmp_path, mock_metadata, caplog, ray_first
):
    ray_left, aws_left = (20, 120) if ray_first else (90, 30)
    server = mock_metadata("aws")
    server.mock.apply("spot", warning=aws_left)
    answers = RayAnswers(_info(ray_left))
    aws = AwsProvider(endpoint_url=server.url, timeout=1.0)
    guard = spotguard.Guard(
        str(tmp_path), providers=[aws, _ray(answers)], interval=0.05, every_steps=None, lease_ttl=None
    )
    stops, events = [], []
    guard.events.add(lambda record: events.append(record["event"]))
    caplog.set_level(logging.WARNING)
    with guard:
        deadline = time.monotonic() + 10
        while not any(n.provider == "aws" for n in guard.watcher.stops) and time.monotonic() < deadline:
            time.sleep(0.01)  # the metadata service's notice first (its watcher thread); Ray's at the next step
        for step in range(1, 6):
            if guard.step(step):
                stops.append(step)
    assert stops == [1, 2, 3, 4, 5] and guard.stopped_at == 1  # one stop: every later step() says stop again
    assert {n.provider for n in guard.watcher.stops} == {"aws", "ray"}
    assert guard.notice is not None and guard.notice.provider == ("ray" if ray_first else "aws")
    (line,) = [r.getMessage() for r in caplog.records if "committed in" in r.getMessage()]
    left = float(re.search(r"T-([\d.]+)s before the deadline", line).group(1))  # type: ignore[union-attr]
    assert min(ray_left, aws_left) - 5 < left <= min(ray_left, aws_left), line
    (info,) = scan(guard.storage)  # one emergency checkpoint
    assert info.step == 1 and info.manifest is not None and info.manifest.reason == "emergency"
    assert events.count("stop") == 1
