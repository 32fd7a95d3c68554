"""The AWS mock behaves like IMDSv2 where clients can tell the difference."""

from __future__ import annotations

import json

import pytest

from spotguard.notices._http import MetadataClient

TTL = "X-aws-ec2-metadata-token-ttl-seconds"


@pytest.fixture
def aws(mock_metadata):
    server = mock_metadata("aws")
    return server, MetadataClient.from_url(server.url)


def token(client: MetadataClient, ttl: str = "60") -> str:
    resp = client.request("PUT", "/latest/api/token", {TTL: ttl})
    assert resp.status == 200 and resp.headers[TTL.lower()] == ttl
    return resp.text


@pytest.mark.parametrize("ttl", [None, "0", "21601", "abc"])
def test_token_request_needs_a_ttl_within_range(aws, ttl):
    _, client = aws
    assert client.request("PUT", "/latest/api/token", {TTL: ttl} if ttl else {}).status == 400


def test_tokens_are_required_and_checked(aws):
    server, client = aws
    path = "/latest/meta-data/instance-id"
    assert client.request("GET", path).status == 401
    assert client.request("GET", path, {"X-aws-ec2-metadata-token": "forged"}).status == 401
    good = token(client)
    resp = client.request("GET", path, {"X-aws-ec2-metadata-token": good})
    assert resp.status == 200 and resp.text == "i-0123456789abcdef0"
    server.mock.expire_tokens()
    assert client.request("GET", path, {"X-aws-ec2-metadata-token": good}).status == 401


def test_expired_ttl_gives_401(aws):
    import time

    _, client = aws
    short = token(client, "1")
    time.sleep(1.1)
    assert client.request("GET", "/latest/meta-data/", {"X-aws-ec2-metadata-token": short}).status == 401


def test_imdsv1_only_when_tokens_are_optional(mock_metadata):
    server = mock_metadata("aws", require_tokens=False)
    assert MetadataClient.from_url(server.url).request("GET", "/latest/meta-data/instance-id").status == 200


def test_not_found_is_an_xhtml_page_and_forwarded_requests_are_refused(aws):
    _, client = aws
    good = {"X-aws-ec2-metadata-token": token(client)}
    resp = client.request("GET", "/latest/meta-data/spot/instance-action", good)
    assert resp.status == 404 and resp.headers["content-type"] == "text/html"
    assert resp.text.startswith('<?xml version="1.0" encoding="iso-8859-1"?>') and "404 - Not Found" in resp.text
    assert client.request("PUT", "/latest/api/token", {TTL: "60", "X-Forwarded-For": "10.0.0.1"}).status == 403


def test_spot_notice_format_and_two_minute_warning(aws):
    import datetime as dt

    server, client = aws
    server.mock.trigger("spot", action="hibernate")
    good = {"X-aws-ec2-metadata-token": token(client)}
    body = json.loads(client.request("GET", "/latest/meta-data/spot/instance-action", good).text)
    assert body["action"] == "hibernate"
    when = dt.datetime.strptime(body["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert 115 <= (when - dt.datetime.now(dt.timezone.utc)).total_seconds() <= 121
    assert client.request("GET", "/latest/meta-data/spot/termination-time", good).text == body["time"]
    server.mock.clear()
    assert client.request("GET", "/latest/meta-data/spot/instance-action", good).status == 404


def test_maintenance_dates_use_the_scheduled_events_format(aws):
    import datetime as dt

    server, client = aws
    good = {"X-aws-ec2-metadata-token": token(client)}
    assert client.request("GET", "/latest/meta-data/events/maintenance/scheduled", good).text == "[]"
    server.mock.trigger("maintenance")
    (event,) = json.loads(client.request("GET", "/latest/meta-data/events/maintenance/scheduled", good).text)
    assert event["State"] == "active" and event["Code"] == "instance-stop"
    dt.datetime.strptime(event["NotBefore"], "%d %b %Y %H:%M:%S GMT")  # e.g. 21 Jan 2019 09:00:43 GMT


# -- issue 17: enough of IMDS for the SDKs' own clients (a rehearsal runs the same code as a VM) ---
def test_listings_mark_directories_and_leaves_answer_with_or_without_a_slash(aws):
    server, client = aws
    good = {"X-aws-ec2-metadata-token": token(client)}
    top = client.request("GET", "/latest/meta-data/", good).text.split("\n")
    assert {"instance-id", "placement/", "iam/", "events/"} <= set(top) and "placement" not in top
    assert client.request("GET", "/latest/meta-data/placement/", good).text.split("\n") == [
        "availability-zone",
        "region",
    ]
    for path in ("/latest/meta-data/placement/availability-zone", "/latest/meta-data/placement/availability-zone/"):
        assert client.request("GET", path, good).text == "us-east-1a"
    assert client.request("GET", "/latest/", good).text.split("\n") == ["dynamic/", "meta-data/"]


def test_gets_carry_the_tokens_remaining_ttl_and_the_real_server_header(aws):
    server, client = aws
    resp = client.request("GET", "/latest/meta-data/instance-id", {"X-aws-ec2-metadata-token": token(client, "300")})
    assert 298 <= int(resp.headers["x-aws-ec2-metadata-token-ttl-seconds"]) <= 300
    assert resp.headers["server"] == "EC2ws"
    assert client.request("GET", "/latest/meta-data/nothing-here", {}).headers["server"] == "EC2ws"


def test_ec2_metadata_library_reads_region_zone_and_identity(aws):
    from ec2_metadata import EC2Metadata

    server, _ = aws
    client = EC2Metadata()
    client.service_url = f"{server.url}/latest/"
    client.metadata_url = f"{client.service_url}meta-data/"
    client.dynamic_url = f"{client.service_url}dynamic/"
    assert client.region == "us-east-1" and client.availability_zone == "us-east-1a"
    assert client.instance_identity_document["instanceId"] == "i-0123456789abcdef0"
    assert client.iam_info["InstanceProfileArn"].endswith("/spotguard-mock-role")


BOTOCORE = """
import json, botocore.session
session = botocore.session.get_session()
creds = session.get_credentials()
frozen = creds.get_frozen_credentials()
from botocore.utils import IMDSRegionProvider
print(json.dumps({"method": creds.method, "key": frozen.access_key, "token": bool(frozen.token),
                  "secret": bool(frozen.secret_key), "region": IMDSRegionProvider(session).provide()}))
"""


def test_botocore_credential_chain_and_region_come_from_the_mock(mock_metadata, tmp_path):
    """What boto3 does on an instance with a role: IMDSv2 token, role name, credentials; the region."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    server = mock_metadata("aws")
    env = {
        k: v
        for k, v in subprocess_env(AWS_EC2_METADATA_SERVICE_ENDPOINT=server.url).items()
        if not k.startswith("AWS_") or k == "AWS_EC2_METADATA_SERVICE_ENDPOINT"
    }
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    out = subprocess.run([sys.executable, "-c", BOTOCORE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["method"] == "iam-role" and got["key"].startswith("ASIA") and got["token"] and got["secret"]
    assert got["key"] == server.mock.credentials["AccessKeyId"]
    assert got["region"] == "us-east-1"
