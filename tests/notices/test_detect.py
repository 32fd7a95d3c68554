"""Cloud auto-detection: the right cloud, quickly, cached, and never more than ~1 s without a cloud."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from spotguard import notices
from spotguard.ops.mockmeta import endpoint_env


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_cloud_is_found_by_its_own_probe_only(mock_metadata, monkeypatch, cloud):
    server = mock_metadata(cloud)
    for name, value in endpoint_env(cloud, server.url).items():
        monkeypatch.setenv(name, value)
    assert notices.detect_clouds(refresh=True) == [cloud]
    names = [p.name for p in notices.build("auto")]
    assert names == ["signal", cloud]


def test_all_probes_against_other_clouds_mocks_find_nothing_wrong(mock_metadata, monkeypatch):
    """Each mock answers only its own cloud's probe: a GCP mock is not mistaken for AWS or Azure."""
    urls = {c: mock_metadata(c).url for c in ("aws", "gcp", "azure")}
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", urls["gcp"])
    monkeypatch.setenv("GCE_METADATA_HOST", urls["azure"].split("://")[1])
    monkeypatch.setenv("SPOTGUARD_AZURE_METADATA_ENDPOINT", urls["aws"])
    assert notices.detect_clouds(refresh=True) == []


def test_no_cloud_is_answered_at_once_and_cached(mock_metadata, monkeypatch):
    # conftest points every endpoint at a closed 127.0.0.1 port: refused at once, no timeout waited for
    t0 = time.monotonic()
    assert notices.detect_clouds(timeout=5.0, refresh=True) == []
    assert time.monotonic() - t0 < 2.5
    server = mock_metadata("aws")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url)
    assert notices.detect_clouds() == ["aws"]
    before = server.mock.requests
    assert notices.detect_clouds() == ["aws"]  # cached: no new request
    assert server.mock.requests == before


def test_a_silent_endpoint_delays_start_by_at_most_about_a_second(monkeypatch):
    """An address that accepts connections but never answers (like a firewall that drops packets)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # never accept(): connects succeed, requests never get an answer
        port = silent.getsockname()[1]
        for name, value in {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}",
            "GCE_METADATA_HOST": f"127.0.0.1:{port}",
            "SPOTGUARD_AZURE_METADATA_ENDPOINT": f"http://127.0.0.1:{port}",
        }.items():
            monkeypatch.setenv(name, value)
        t0 = time.monotonic()
        assert notices.detect_clouds(refresh=True) == []
        took = time.monotonic() - t0
    assert 0.4 < took < 1.5  # probed in parallel (0.5 s, 0.75 s for AWS's IMDSv1 try); one by one: over 1.75 s


def test_aws_refusing_the_token_is_found_only_with_the_imdsv1_opt_in(mock_metadata, monkeypatch):
    server = mock_metadata("aws", require_tokens=False)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url)
    server.set_faults(status=403, count=1)  # the token request is refused
    assert notices.detect_clouds(refresh=True) == []
    monkeypatch.setenv("SPOTGUARD_AWS_ALLOW_IMDSV1", "1")
    server.set_faults(status=403, count=1)
    assert notices.detect_clouds(refresh=True) == ["aws"]


@pytest.mark.parametrize("tokens_required", [True, False])
def test_a_token_timeout_behind_a_hop_limit_is_still_aws_with_a_warning(
    mock_metadata, monkeypatch, caplog, tokens_required
):
    """A container one hop too far: the IMDSv2 token's answer is dropped, IMDSv1 GETs get through."""
    server = mock_metadata("aws", require_tokens=tokens_required)
    original = server.mock.handle

    def hop_limit(req):
        if req.method == "PUT":
            time.sleep(5.0)  # the answer never comes back (daemon threads: the server stops without it)
        return original(req)

    server.mock.handle = hop_limit
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "spotguard.notices"):
        assert notices.detect_clouds(refresh=True) == ["aws"]  # not a silent "no cloud"
    assert time.monotonic() - t0 < 3.0  # the 0.5 s token timeout, not the 5 s the answer would take
    assert "hop limit" in caplog.text
