"""The Azure mock behaves like IMDS Scheduled Events where clients can tell the difference."""

from __future__ import annotations

import json

from spotguard.notices._http import MetadataClient
from spotguard.notices.azure import parse_rfc1123
from spotguard.notices.base import utcnow

EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
H = {"Metadata": "true"}


def test_metadata_header_and_api_version_are_required(mock_metadata):
    client = MetadataClient.from_url(mock_metadata("azure").url)
    no_header = client.request("GET", EVENTS)
    assert no_header.status == 400 and "metadata header" in json.loads(no_header.body)["error"]
    assert client.request("GET", "/metadata/scheduledevents", H).status == 400
    assert client.request("GET", EVENTS, {**H, "X-Forwarded-For": "1.2.3.4"}).status == 400
    name = client.request("GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text", H)
    assert name.status == 200 and name.text == "spot-trainer-1"


def test_incarnation_grows_preempt_is_30s_ahead_and_start_requests_are_recorded(mock_metadata):
    server = mock_metadata("azure")
    client = MetadataClient.from_url(server.url)
    empty = json.loads(client.request("GET", EVENTS, H).body)
    assert empty["Events"] == []
    server.mock.trigger("preempt")
    doc = json.loads(client.request("GET", EVENTS, H).body)
    assert doc["DocumentIncarnation"] > empty["DocumentIncarnation"]
    (event,) = doc["Events"]
    assert event["EventType"] == "Preempt" and event["EventStatus"] == "Scheduled"
    assert 28 <= (parse_rfc1123(event["NotBefore"]) - utcnow()).total_seconds() <= 30
    assert client.request("POST", EVENTS, H, b"{not json").status == 400
    body = json.dumps({"StartRequests": [{"EventId": event["EventId"]}]}).encode()
    assert client.request("POST", EVENTS, H, body).status == 200
    after = json.loads(client.request("GET", EVENTS, H).body)
    assert after["Events"][0]["EventStatus"] == "Started"
    assert after["DocumentIncarnation"] > doc["DocumentIncarnation"]
    assert server.mock.acks == [event["EventId"]]
