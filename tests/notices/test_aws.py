"""The AWS provider against the mock IMDS over real HTTP (and ec2-metadata against the same mock)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time

import pytest

from spotguard import Watcher, notices
from spotguard.notices._http import MetadataHTTPError
from spotguard.notices.aws import AwsProvider, parse_maintenance_time
from spotguard.notices.base import utcnow


def provider(server, **options) -> AwsProvider:
    return AwsProvider(server.url, **options)


def test_no_notice_then_spot_termination_with_its_two_minute_deadline(mock_metadata):
    server = mock_metadata("aws")
    p = provider(server)
    assert p.poll() is None
    shown = server.mock.trigger("spot")
    notice = p.poll()
    assert notice is not None and notice.kind == "terminate" and not notice.advisory
    assert notice.deadline == dt.datetime.strptime(shown["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert 110 < notice.seconds_left() <= 121
    assert notice.raw == {"action": "terminate", "time": shown["time"]}


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_spot_stop_and_hibernate_actions_are_notices_of_that_kind(mock_metadata, action):
    server = mock_metadata("aws")
    server.mock.trigger("spot", action=action)
    assert provider(server).poll().kind == action


def test_rebalance_is_advisory_and_a_spot_notice_outranks_it(mock_metadata):
    server = mock_metadata("aws")
    p = provider(server)
    server.mock.trigger("rebalance")
    notice = p.poll()
    assert notice.kind == "rebalance" and notice.advisory and "noticeTime" in notice.raw
    server.mock.trigger("spot")
    assert p.poll().kind == "terminate"


def test_active_maintenance_within_the_horizon_is_a_notice(mock_metadata):
    server = mock_metadata("aws")
    event = server.mock.trigger("maintenance", warning=300)
    notice = provider(server).poll()
    assert notice.kind == "maintenance"
    assert notice.deadline == parse_maintenance_time(event["NotBefore"])
    assert provider(server, maintenance_horizon=60).poll() is None  # announced too far ahead


def test_maintenance_that_is_canceled_unknown_or_badly_dated_is_not_a_stop(mock_metadata, caplog):
    server = mock_metadata("aws")
    soon = (utcnow() + dt.timedelta(seconds=60)).strftime("%d %b %Y %H:%M:%S GMT")
    server.mock.values["events/maintenance/scheduled"] = json.dumps(
        [
            {"Code": "instance-stop", "NotBefore": soon, "State": "canceled", "EventId": "e1"},
            {"Code": "instance-stop", "NotBefore": soon, "State": "completed", "EventId": "e2"},
            {"Code": "instance-stop", "NotBefore": "next tuesday", "State": "active", "EventId": "e3"},
        ]
    )
    with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
        assert provider(server).poll() is None
    assert "bad NotBefore" in caplog.text


def test_auto_scaling_scale_in_is_a_terminate_notice(mock_metadata):
    server = mock_metadata("aws")
    p = provider(server)
    server.mock.values["autoscaling/target-lifecycle-state"] = "InService"
    assert p.poll() is None
    server.mock.trigger("asg")
    assert p.poll().kind == "terminate"


def test_malformed_json_is_logged_and_never_a_stop(mock_metadata, caplog):
    server = mock_metadata("aws")
    p = provider(server)
    for body in ("{not json", '{"action": "explode", "time": "2026-01-01T00:00:00Z"}', "[1, 2]"):
        server.mock.values["spot/instance-action"] = body
        with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
            assert p.poll() is None
    server.mock.values["events/maintenance/scheduled"] = "{oops"
    server.mock.values.pop("spot/instance-action")
    assert p.poll() is None
    assert "malformed JSON" in caplog.text and "unexpected content" in caplog.text


def test_a_valid_action_with_a_bad_time_still_stops_with_the_documented_two_minutes(mock_metadata, caplog):
    server = mock_metadata("aws")
    server.mock.values["spot/instance-action"] = json.dumps({"action": "terminate", "time": "soon"})
    with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
        notice = provider(server).poll()
    assert notice.kind == "terminate" and 115 < notice.seconds_left() <= 120
    assert "bad time" in caplog.text


def answers(server) -> list[tuple[str, int]]:
    """(method, status) of every request the mock answers from now on, in order."""
    seen: list[tuple[str, int]] = []
    original = server.mock.handle

    def handle(req):
        reply = original(req)
        seen.append((req.method, reply.status))
        return reply

    server.mock.handle = handle
    return seen


def test_token_is_reused_and_refreshed_after_a_401(mock_metadata):
    server = mock_metadata("aws")
    seen = answers(server)
    p = provider(server)
    p.poll()
    p.poll()
    assert [m for m, _ in seen].count("PUT") == 1  # one token for many polls
    server.mock.expire_tokens()
    server.mock.trigger("spot")
    assert p.poll().kind == "terminate"  # the 401 led to a new token, not to an error
    assert ("GET", 401) in seen and [m for m, _ in seen].count("PUT") == 2


def test_token_is_renewed_before_it_expires(mock_metadata):
    server = mock_metadata("aws")
    seen = answers(server)
    p = provider(server, token_ttl=1)
    p.poll()
    time.sleep(0.85)  # past 80 % of the TTL (or past all of it on a busy machine: renewed first all the same)
    p.poll()
    assert [m for m, _ in seen].count("PUT") == 2 and ("GET", 401) not in seen, seen


def test_no_silent_imdsv1_fallback(mock_metadata):
    server = mock_metadata("aws", require_tokens=False)
    server.set_faults(status=403, count=1)  # the token request is refused
    with pytest.raises(MetadataHTTPError, match="token"):
        provider(server).poll()
    server.set_faults(status=403, count=1)
    server.mock.trigger("spot")
    assert provider(server, allow_imdsv1=True).poll().kind == "terminate"


def test_provider_built_by_name_falls_back_to_imdsv1_only_with_the_environment_opt_in(mock_metadata, monkeypatch):
    server = mock_metadata("aws", require_tokens=False)
    server.mock.trigger("spot")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url)
    server.set_faults(status=403, count=1)  # the token request is refused
    with pytest.raises(MetadataHTTPError, match="token"):
        notices.build("aws")[0].poll()
    monkeypatch.setenv("SPOTGUARD_AWS_ALLOW_IMDSV1", "1")
    server.set_faults(status=403, count=1)
    assert notices.build("aws")[0].poll().kind == "terminate"


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_raise_for_the_watcher_to_back_off(mock_metadata, status):
    server = mock_metadata("aws")
    p = provider(server)
    p.poll()
    server.set_faults(status=status, count=1)
    with pytest.raises(MetadataHTTPError, match=str(status)):
        p.poll()
    assert p.poll() is None


def test_a_slow_service_times_out(mock_metadata):
    server = mock_metadata("aws")
    server.set_faults(status=0, count=1, delay=5.0)
    t0 = time.monotonic()
    with pytest.raises(MetadataHTTPError, match="timed out"):
        provider(server, timeout=0.2).poll()
    assert time.monotonic() - t0 < 3.0  # the 0.2 s timeout, not the 5 s answer


def test_an_answer_dripped_a_byte_at_a_time_does_not_stall_the_watcher(mock_metadata):
    """Issue 22: the timeout was per read; a token dripped a byte every 0.25 s took 14 s."""
    server = mock_metadata("aws")
    server.mock.trigger("spot")
    server.set_faults(status=0, count=1, drip=0.25)  # the first answer, the IMDSv2 token (56 bytes)
    t0 = time.monotonic()
    with Watcher([provider(server, timeout=0.5)], interval=0.2) as watcher:
        assert watcher.preempted.wait(10)
    assert time.monotonic() - t0 < 3.0, time.monotonic() - t0  # a 0.5 s request, then a retry
    assert watcher.notice.kind == "terminate"


def test_watcher_survives_503s_reports_once_and_only_on_a_real_notice(mock_metadata):
    server = mock_metadata("aws")
    seen = []
    watcher = Watcher([provider(server)], interval=0.05, on_notice=seen.append, max_backoff=0.1)
    with watcher:
        server.set_faults(status=503, count=4)
        time.sleep(0.5)
        assert not watcher.preempted.is_set()
        server.mock.trigger("spot")
        assert watcher.preempted.wait(2)
        time.sleep(0.3)  # many more polls see the same notice
    assert len(seen) == 1 and seen[0].kind == "terminate"


def test_stop_is_prompt_even_mid_request(mock_metadata):
    server = mock_metadata("aws")
    server.set_faults(status=0, count=100, delay=5.0)
    watcher = Watcher([provider(server, timeout=10)], interval=0.05).start()
    time.sleep(0.2)
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 2.5  # not the 5 s the request in flight takes
    assert not any(t.name.startswith("spotguard-watch") for t in threading.enumerate())


def test_ec2_metadata_library_reads_the_mock_spot_notice(mock_metadata):
    from ec2_metadata import EC2Metadata

    server = mock_metadata("aws")
    client = EC2Metadata()
    client.service_url = f"{server.url}/latest/"
    client.metadata_url = f"{client.service_url}meta-data/"
    assert client.spot_instance_action is None
    assert client.instance_id == "i-0123456789abcdef0"
    shown = server.mock.trigger("spot", action="stop")
    client.clear_all()
    action = client.spot_instance_action
    assert action.action == "stop"
    assert action.time.strftime("%Y-%m-%dT%H:%M:%SZ") == shown["time"]


def test_a_found_spot_notice_survives_a_failing_later_read(mock_metadata):
    server = mock_metadata("aws")
    original = server.mock.handle
    server.mock.handle = lambda req: type(original(req))(503) if "maintenance" in req.path else original(req)
    p = provider(server)
    with pytest.raises(MetadataHTTPError):
        p.poll()  # nothing found, then the maintenance read fails: the watcher backs off
    server.mock.trigger("spot")
    assert p.poll().kind == "terminate"


def test_the_same_malformed_content_warns_once(mock_metadata, caplog):
    server = mock_metadata("aws")
    server.mock.values["spot/instance-action"] = "{broken"
    p = provider(server)
    with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
        for _ in range(5):
            p.poll()
    assert caplog.text.count("malformed JSON") == 1


# -- issue 17: notices as real clouds send them ------------------------------------------------
@pytest.mark.parametrize(
    "code", ["instance-retirement", "instance-stop", "instance-reboot", "system-reboot", "system-maintenance"]
)
def test_every_documented_scheduled_event_code_is_a_stop_notice(mock_metadata, code):
    server = mock_metadata("aws")
    event = server.mock.trigger("maintenance", action=code, warning=300)
    notice = provider(server).poll()
    assert notice is not None and notice.kind == "maintenance" and not notice.advisory
    assert notice.raw["Code"] == code and notice.event_id == f"aws-maintenance-{event['EventId']}"


def test_a_stale_spot_time_gives_the_documented_two_minutes_not_a_passed_deadline(mock_metadata, caplog):
    server = mock_metadata("aws")
    # the payload of the AWS Node Termination Handler's test fixtures: a time long past
    server.mock.values["spot/instance-action"] = json.dumps({"action": "terminate", "time": "2017-09-18T08:22:00Z"})
    with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
        notice = provider(server).poll()
    assert notice.kind == "terminate" and 115 < notice.seconds_left() <= 120
    assert "has passed" in caplog.text


def _scheduled(not_before: dt.datetime, not_after: dt.datetime | None = None, code="system-reboot") -> str:
    fmt = "%d %b %Y %H:%M:%S GMT"
    event = {
        "Code": code,
        "Description": "scheduled reboot",
        "EventId": "instance-event-0d59937288b749b32",
        "NotBefore": not_before.strftime(fmt),
        "State": "active",
    }
    if not_after is not None:
        event["NotAfter"] = not_after.strftime(fmt)
    return json.dumps([event])


def test_a_maintenance_window_already_open_leaves_two_minutes_not_its_not_after(mock_metadata):
    """Issue 22: NotAfter is the window's latest end (7 days in the public AWS mock's default event);
    the event may start at any moment of an open window."""
    server = mock_metadata("aws")
    event = server.mock.trigger("maintenance", action="system-reboot", warning=-600, window=7 * 86400)
    assert parse_maintenance_time(event["NotAfter"]) - utcnow() > dt.timedelta(days=6)
    notice = provider(server).poll()
    assert notice.kind == "maintenance" and 115 < notice.seconds_left() <= 120
    server.mock.trigger("maintenance", action="instance-retirement", warning=-600)  # no NotAfter at all
    notice = provider(server).poll()
    assert notice.kind == "maintenance" and 115 < notice.seconds_left() <= 120
    server.mock.trigger("maintenance", action="system-reboot", warning=90, window=7 * 86400)  # not yet open
    notice = provider(server).poll()
    assert notice.kind == "maintenance" and 85 < notice.seconds_left() <= 90  # NotBefore


def test_notices_whose_times_are_restamped_on_every_request_are_one_notice_each(mock_metadata):
    """The public AWS metadata mock recomputes ``time`` and ``noticeTime`` on every request."""
    server = mock_metadata("aws")
    original, served = server.mock.handle, [0]

    def restamping(req):
        served[0] += 1
        stamp = (utcnow() + dt.timedelta(seconds=served[0])).strftime("%Y-%m-%dT%H:%M:%SZ")
        server.mock.values["events/recommendations/rebalance"] = json.dumps({"noticeTime": stamp})
        if served[0] > 40:  # later, a spot interruption whose time moves as well
            later = (utcnow() + dt.timedelta(seconds=120 + served[0])).strftime("%Y-%m-%dT%H:%M:%SZ")
            server.mock.values["spot/instance-action"] = json.dumps({"action": "stop", "time": later})
        return original(req)

    server.mock.handle = restamping
    seen = []
    with Watcher([provider(server)], interval=0.02, on_notice=seen.append) as watcher:
        assert watcher.preempted.wait(10)
        time.sleep(0.3)  # more polls, more restamped payloads
    assert [n.kind for n in seen] == ["rebalance", "stop"]
    assert len({n.raw["noticeTime"] for n in seen if n.kind == "rebalance"}) == 1


def test_token_timeout_behind_a_hop_limit_is_a_clear_error_and_falls_back_to_v1_when_allowed(mock_metadata, caplog):
    """In a container behind an IMDS hop limit of 1, the token's answer is dropped: the PUT times out."""
    server = mock_metadata("aws", require_tokens=False)
    original = server.mock.handle

    puts = []

    def hop_limit(req):
        if req.method == "PUT":
            puts.append(req.path)
            time.sleep(1.0)  # the answer never reaches the container
        return original(req)

    server.mock.handle = hop_limit
    with pytest.raises(MetadataHTTPError, match="hop limit"):
        provider(server, timeout=0.2).poll()
    server.mock.trigger("spot")
    p = provider(server, timeout=0.2, allow_imdsv1=True)  # what SPOTGUARD_AWS_ALLOW_IMDSV1=1 builds
    with caplog.at_level(logging.WARNING, "spotguard.notices.aws"):
        assert p.poll().kind == "terminate"
        tried = len(puts)
        assert p.poll().kind == "terminate"
    assert len(puts) == tried  # IMDSv1 from then on: no token request (and timeout) on every poll
    assert "IMDSv2 token request timed out" in caplog.text and "using IMDSv1" in caplog.text


def test_a_token_timeout_warns_again_every_few_minutes_and_never_logs_a_token(mock_metadata, caplog):
    server = mock_metadata("aws")
    original = server.mock.handle
    stall = threading.Event()

    def hop_limit(req):
        if req.method == "PUT" and stall.is_set():
            time.sleep(0.5)
        return original(req)

    server.mock.handle = hop_limit
    p = provider(server, timeout=0.1)
    assert p.poll() is None and server.mock.tokens  # a token was issued (it must never show in the logs)
    issued = list(server.mock.tokens)
    stall.set()
    server.mock.expire_tokens()  # the next GET gets a 401, the new token's answer never comes
    caplog.set_level(logging.DEBUG, logger="spotguard")
    with Watcher([p], interval=0.05, max_backoff=0.2, warn_every=1.0) as watcher:
        time.sleep(3.5)
        assert watcher.running
    failed = [r for r in caplog.records if r.name == "spotguard.watcher" and "hop limit" in r.getMessage()]
    warnings = [r for r in failed if r.levelno == logging.WARNING]
    assert len(failed) >= 6  # polled on, about every 0.3 s
    assert 2 <= len(warnings) <= 5 < len(failed), (len(warnings), len(failed))  # again each 1 s, not every poll
    assert not any(token in caplog.text for token in issued)


def test_a_garbled_token_is_refused_and_polling_recovers_after_the_storm(mock_metadata):
    """A storm's random bytes as the token answer: kept, they were sent as a header for hours."""
    server = mock_metadata("aws")
    server.mock.trigger("spot")
    original, state = server.mock.handle, {"garble": True}

    def garbled_token(req):
        if req.method == "PUT" and state.pop("garble", False):
            return type(original(req))(200, "\u00e9\u00a7\x85 not a token".encode(), {})
        return original(req)

    server.mock.handle = garbled_token
    p = provider(server)
    with pytest.raises(MetadataHTTPError, match="not a token"):
        p.poll()
    assert p.poll().kind == "terminate"


def test_a_request_that_cannot_be_sent_leaves_the_connection_usable(mock_metadata):
    from spotguard.notices._http import MetadataClient

    client = MetadataClient.from_url(mock_metadata("aws").url)
    with pytest.raises(MetadataHTTPError):
        client.request("GET", "/latest/meta-data/instance-id", {"X-aws-ec2-metadata-token": "\u0101\u0102"})
    assert client.request("GET", "/latest/meta-data/instance-id", {}).status == 401  # not "Request-started"
