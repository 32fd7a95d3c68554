"""The GCP mock behaves like the GCE metadata server where clients can tell the difference."""

from __future__ import annotations

import json
import threading
import time

from spotguard.notices._http import MetadataClient

FLAVOR = {"Metadata-Flavor": "Google"}
PREEMPTED = "/computeMetadata/v1/instance/preempted"


def test_flavor_header_is_required_and_always_answered(mock_metadata):
    client = MetadataClient.from_url(mock_metadata("gcp").url)
    refused = client.request("GET", PREEMPTED)
    assert refused.status == 403 and refused.headers["metadata-flavor"] == "Google"
    ok = client.request("GET", PREEMPTED, FLAVOR)
    assert ok.status == 200 and ok.text == "FALSE" and ok.headers["metadata-flavor"] == "Google"
    assert ok.headers["content-type"] == "application/text" and ok.headers["etag"]
    root = client.request("GET", "/")
    assert root.status == 200 and root.headers["metadata-flavor"] == "Google"
    assert client.request("GET", PREEMPTED, {**FLAVOR, "X-Forwarded-For": "1.2.3.4"}).status == 403
    missing = client.request("GET", "/computeMetadata/v1/instance/nope", FLAVOR)
    assert missing.status == 404 and "Error 404" in missing.text


def test_directory_listing_and_recursive_json(mock_metadata):
    client = MetadataClient.from_url(mock_metadata("gcp").url)
    listing = client.request("GET", "/computeMetadata/v1/instance/", FLAVOR).text.split()
    assert "preempted" in listing and "scheduling/" in listing
    rec = client.request("GET", "/computeMetadata/v1/instance/scheduling/?recursive=true", FLAVOR)
    assert rec.headers["content-type"] == "application/json" and json.loads(rec.text)["provisioningModel"] == "SPOT"


def test_hanging_get_blocks_while_the_etag_is_unchanged_and_returns_on_change(mock_metadata):
    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=10)
    etag = client.request("GET", PREEMPTED, FLAVOR).headers["etag"]
    t0 = time.monotonic()
    same = client.request("GET", f"{PREEMPTED}?wait_for_change=true&last_etag={etag}&timeout_sec=1", FLAVOR)
    assert 0.9 < time.monotonic() - t0 < 6 and same.text == "FALSE" and same.headers["etag"] == etag
    threading.Timer(0.3, server.mock.trigger, ("preempt",)).start()
    t0 = time.monotonic()
    changed = client.request("GET", f"{PREEMPTED}?wait_for_change=true&last_etag={etag}&timeout_sec=30", FLAVOR)
    assert time.monotonic() - t0 < 8  # held until the change (TRUE), not for the 30 s
    assert changed.text == "TRUE" and changed.headers["etag"] != etag
    t0 = time.monotonic()  # an old etag: the answer is immediate
    stale = client.request("GET", f"{PREEMPTED}?wait_for_change=true&last_etag={etag}&timeout_sec=30", FLAVOR)
    assert time.monotonic() - t0 < 8 and stale.text == "TRUE"  # not held for the 30 s


def test_hanging_get_without_etag_waits_for_the_next_change(mock_metadata):
    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=10)
    threading.Timer(0.3, server.mock.trigger, ("maintenance",)).start()
    t0 = time.monotonic()
    resp = client.request("GET", "/computeMetadata/v1/instance/maintenance-event?wait_for_change=true", FLAVOR)
    assert time.monotonic() - t0 < 8 and resp.text == "TERMINATE_ON_HOST_MAINTENANCE"  # held until the change


GOOGLE_AUTH_CREDENTIALS = """
import json
import google.auth.transport.requests as tr
from google.auth import compute_engine
creds = compute_engine.Credentials()
creds.refresh(tr.Request())
print(json.dumps({"token": creds.token, "email": creds.service_account_email, "scopes": list(creds.scopes or []),
                  "valid": creds.valid}))
"""


def test_google_auth_compute_engine_credentials_refresh_against_the_mock(mock_metadata):
    import subprocess
    import sys

    from spotguard.ops.mockmeta import endpoint_env
    from tests.helpers import subprocess_env

    server = mock_metadata("gcp")
    env = subprocess_env(**endpoint_env("gcp", server.url))  # google-auth reads them at import time
    out = subprocess.run(
        [sys.executable, "-c", GOOGLE_AUTH_CREDENTIALS], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["valid"] and got["token"].startswith("ya29.mock-")
    assert got["email"] == "123456789012-compute@developer.gserviceaccount.com"
    assert "https://www.googleapis.com/auth/cloud-platform" in got["scopes"]


def test_service_account_listing_is_json_with_lists_and_the_server_header_is_googles(mock_metadata):
    client = MetadataClient.from_url(mock_metadata("gcp").url)
    resp = client.request("GET", "/computeMetadata/v1/instance/service-accounts/default/?recursive=true", FLAVOR)
    assert json.loads(resp.text) == {
        "aliases": ["default"],
        "email": "123456789012-compute@developer.gserviceaccount.com",
        "scopes": ["https://www.googleapis.com/auth/cloud-platform", "https://www.googleapis.com/auth/userinfo.email"],
    }
    assert resp.headers["server"] == "Metadata Server for VM"
    listing = client.request("GET", "/computeMetadata/v1/instance/service-accounts/", FLAVOR).text.split()
    assert listing == ["123456789012-compute@developer.gserviceaccount.com/", "default/"]
    token = client.request("GET", "/computeMetadata/v1/instance/service-accounts/default/token", FLAVOR)
    assert token.headers["content-type"] == "application/json" and json.loads(token.text)["expires_in"] > 0
