"""The Azure provider against the mock Scheduled Events service over real HTTP, and the acknowledgement."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

import spotguard
from spotguard import notices
from spotguard.checkpoint import scan
from spotguard.notices._http import MetadataHTTPError
from spotguard.notices.azure import AzureProvider, parse_rfc1123


def test_preempt_event_for_this_vm_is_a_notice_with_not_before_as_deadline(mock_metadata):
    server = mock_metadata("azure", vm_name="trainer-7")
    p = AzureProvider(server.url)
    assert p.poll() is None and p.vm_name == "trainer-7"
    event = server.mock.trigger("preempt")
    notice = p.poll()
    assert notice.kind == "preempt" and not notice.advisory
    assert notice.deadline == parse_rfc1123(event["NotBefore"])
    assert 27 < notice.seconds_left() <= 30
    assert notice.event_id == f"azure-preempt-{event['EventId']}"
    assert p.incarnation == server.mock.incarnation


def test_terminate_is_a_notice_other_vms_and_freeze_are_not(mock_metadata):
    server = mock_metadata("azure")
    p = AzureProvider(server.url)
    server.mock.trigger("preempt", resources=["someone-else"])
    server.mock.trigger("reboot", resources=["someone-else"])
    server.mock.trigger("freeze")  # a pause of seconds: memory and disks are kept
    assert p.poll() is None
    server.mock.trigger("terminate")
    assert p.poll().kind == "terminate"


@pytest.mark.parametrize(("kind", "lead"), [("reboot", 900), ("redeploy", 600)])
def test_reboot_and_redeploy_of_this_vm_are_stop_notices(mock_metadata, kind, lead):
    """A reboot loses the VM's memory, a redeploy moves it to another host: both end the run."""
    server = mock_metadata("azure")
    event = server.mock.trigger(kind)
    notice = AzureProvider(server.url).poll()
    assert notice is not None and notice.kind == kind and not notice.advisory
    assert notice.deadline == parse_rfc1123(event["NotBefore"]) and lead - 3 < notice.seconds_left() <= lead
    assert notice.event_id == f"azure-{kind}-{event['EventId']}"


def test_which_events_stop_is_configurable(mock_metadata, monkeypatch):
    server = mock_metadata("azure")
    server.mock.trigger("reboot")
    assert AzureProvider(server.url, stop_events=["Preempt", "Terminate"]).poll() is None
    monkeypatch.setenv("SPOTGUARD_AZURE_METADATA_ENDPOINT", server.url)
    monkeypatch.setenv("SPOTGUARD_AZURE_STOP_EVENTS", "preempt,terminate")
    assert notices.build("azure")[0].poll() is None
    monkeypatch.setenv("SPOTGUARD_AZURE_STOP_EVENTS", "Preempt,Freeze")
    server.mock.trigger("freeze")
    assert notices.build("azure")[0].poll().kind == "freeze"
    monkeypatch.setenv("SPOTGUARD_AZURE_STOP_EVENTS", "Preempt,Reboots")
    with pytest.raises(spotguard.ConfigError, match="SPOTGUARD_AZURE_STOP_EVENTS.*Reboots"):
        notices.build("azure")
    monkeypatch.setenv("SPOTGUARD_AZURE_STOP_EVENTS", " , ")  # no event would ever stop training
    with pytest.raises(spotguard.ConfigError, match="SPOTGUARD_AZURE_STOP_EVENTS.*no Azure event type"):
        notices.build("azure")


def test_an_event_already_started_or_past_its_not_before_leaves_30s_not_zero(mock_metadata):
    server = mock_metadata("azure")
    server.mock.trigger("preempt")
    event = server.mock.events[-1]
    event["EventStatus"], event["NotBefore"] = "Started", ""  # as Azure shows an event under way
    server.mock.incarnation += 1
    notice = AzureProvider(server.url).poll()
    assert notice.kind == "preempt" and 28 < notice.seconds_left() <= 30
    event["EventStatus"], event["NotBefore"] = "Scheduled", "Mon, 19 Sep 2016 18:29:47 GMT"  # the docs' example
    server.mock.incarnation += 1
    notice = AzureProvider(server.url).poll()
    assert notice.kind == "preempt" and 28 < notice.seconds_left() <= 30


def test_a_bad_not_before_assumes_the_event_types_documented_notice(mock_metadata):
    server = mock_metadata("azure")
    server.mock.trigger("redeploy")
    server.mock.events[-1]["NotBefore"] = "soon"
    server.mock.incarnation += 1
    notice = AzureProvider(server.url).poll()
    assert notice.kind == "redeploy" and 595 < notice.seconds_left() <= 600


def test_a_garbled_vm_name_is_never_kept(mock_metadata):
    server = mock_metadata("azure")
    original, state = server.mock.handle, {"garbled": True}

    def once_garbled(req):
        if "compute/name" in req.path and state.pop("garbled", False):
            return type(original(req))(200, b"\x8b\x00<html>oops", {})
        return original(req)

    server.mock.handle = once_garbled
    p = AzureProvider(server.url)
    with pytest.raises(ValueError, match="not a VM name"):
        p.poll()
    server.mock.trigger("preempt")
    assert p.poll().kind == "preempt" and p.vm_name == "spot-trainer-1"


def test_unchanged_incarnation_keeps_the_same_notice(mock_metadata):
    server = mock_metadata("azure")
    p = AzureProvider(server.url)
    server.mock.trigger("preempt")
    first = p.poll()
    assert p.poll() is first
    server.mock.clear()
    assert p.poll() is None


def test_malformed_documents_and_bad_dates_are_logged_without_a_false_stop(mock_metadata, caplog):
    server = mock_metadata("azure")
    p = AzureProvider(server.url)
    original = server.mock.handle

    def broken(req):
        if req.path == "/metadata/scheduledevents":
            return type(original(req))(200, b'{"DocumentIncarnation": "x", "Events": ', {})
        return original(req)

    server.mock.handle = broken
    with caplog.at_level(logging.WARNING, "spotguard.notices.azure"):
        assert p.poll() is None
    assert "malformed document" in caplog.text
    server.mock.handle = original
    event = server.mock.trigger("preempt")
    event_in_mock = server.mock.events[-1]
    event_in_mock["NotBefore"] = "not a date"
    server.mock.incarnation += 1
    with caplog.at_level(logging.WARNING, "spotguard.notices.azure"):
        notice = p.poll()
    assert notice.kind == "preempt" and 28 < notice.seconds_left() <= 30
    assert event["EventId"] in caplog.text


def test_missing_header_or_errors_raise(mock_metadata):
    server = mock_metadata("azure")
    server.set_faults(status=503, count=1)
    with pytest.raises(MetadataHTTPError, match="503"):
        AzureProvider(server.url).poll()
    with pytest.raises(MetadataHTTPError, match="401"):  # the AWS mock is no Azure: it wants a token
        AzureProvider(mock_metadata("aws").url).poll()


def test_acknowledge_approves_the_event_once(mock_metadata):
    server = mock_metadata("azure")
    p = AzureProvider(server.url)
    server.mock.trigger("preempt")
    notice = p.poll()
    p.acknowledge(notice)
    p.acknowledge(notice)
    assert server.mock.acks == [notice.raw["EventId"]]
    assert server.mock.events[0]["EventStatus"] == "Started"
    started = p.poll()
    assert started.event_id == notice.event_id  # the same event, reported once by the watcher
    quiet = AzureProvider(server.url, ack=False)
    server.mock.trigger("preempt")
    quiet.acknowledge(quiet.poll())
    assert len(server.mock.acks) == 1


def test_provider_built_by_name_does_not_acknowledge_with_spotguard_azure_ack_0(mock_metadata, monkeypatch):
    server = mock_metadata("azure")
    monkeypatch.setenv("SPOTGUARD_AZURE_METADATA_ENDPOINT", server.url)
    server.mock.trigger("preempt")
    monkeypatch.setenv("SPOTGUARD_AZURE_ACK", "0")
    quiet = notices.build("azure")[0]
    quiet.acknowledge(quiet.poll())
    assert server.mock.acks == []
    monkeypatch.delenv("SPOTGUARD_AZURE_ACK")
    default = notices.build("azure")[0]
    default.acknowledge(default.poll())
    assert len(server.mock.acks) == 1


def _guarded_loop(storage, provider, server, steps=200):
    model = torch.nn.Linear(2, 2)
    guard = spotguard.Guard(
        storage, providers=[provider], interval=0.05, lease_ttl=None
    )  # the save fails, not the start
    guard.track(model=model)
    with guard:
        for step in range(1, steps):
            if step == 3:
                server.mock.trigger("preempt")
            time.sleep(0.02)
            if guard.step(step):
                return guard, step
    return guard, None


def test_guard_acknowledges_only_after_the_emergency_checkpoint_is_committed(mock_metadata, tmp_path):
    server = mock_metadata("azure")
    committed_at_ack = []
    original = server.mock.handle

    def spy(req):  # what storage holds at the moment the acknowledgement arrives
        if req.method == "POST":
            committed_at_ack.append(
                [i.step for i in scan(spotguard.open_storage(str(tmp_path / "ckpt"))) if i.complete]
            )
        return original(req)

    server.mock.handle = spy
    guard, stopped = _guarded_loop(str(tmp_path / "ckpt"), AzureProvider(server.url), server)
    assert stopped is not None and guard.notice.provider == "azure"
    assert server.mock.acks == [guard.notice.raw["EventId"]]
    assert committed_at_ack == [[stopped]]


def test_no_acknowledgement_when_the_emergency_checkpoint_fails(mock_metadata, tmp_path):
    server = mock_metadata("azure")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    guard, stopped = _guarded_loop(str(blocker / "ckpt"), AzureProvider(server.url), server)
    assert stopped is not None and guard.emergency_error is not None
    assert server.mock.acks == []
    assert json.loads(json.dumps(server.mock.state()))["events"][0]["EventStatus"] == "Scheduled"


def test_a_malformed_entry_before_a_preempt_is_skipped_and_the_preempt_seen_at_once(mock_metadata, caplog):
    """Issue 22: the document's incarnation was recorded before its parse failed: never read again."""
    server = mock_metadata("azure")
    event = server.mock.trigger("preempt")
    bad = {"EventId": "BAD-ENTRY", "EventType": "Preempt", "Resources": 5, "EventStatus": "Scheduled"}
    with server.mock.cond:
        server.mock.events.insert(0, bad)
        server.mock.incarnation += 1
    p = AzureProvider(server.url)
    with caplog.at_level(logging.WARNING, "spotguard.notices.azure"):
        notice = p.poll()
        assert notice is not None and notice.event_id == f"azure-preempt-{event['EventId']}"
        assert p.poll() is notice  # the same document: not parsed again, the same notice
    assert ["BAD-ENTRY" in r.getMessage() for r in caplog.records] == [True]  # one warning, naming it
    seen = []
    with spotguard.Watcher([AzureProvider(server.url)], interval=0.2, on_notice=seen.append) as watcher:
        assert watcher.preempted.wait(3)  # not after 30 s of failed parses
    assert [n.event_id for n in seen] == [notice.event_id]
