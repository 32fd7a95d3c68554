"""The shared metadata HTTP client against hostile answers of the mock server, over real HTTP: a
request's whole time is bounded (not each read), and a huge answer is refused without holding it."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from spotguard.notices._http import MetadataClient, MetadataHTTPError

PREEMPTED = "/computeMetadata/v1/instance/preempted"
FLAVOR = {"Metadata-Flavor": "Google"}


def test_an_answer_dripped_a_byte_at_a_time_ends_at_the_request_timeout(mock_metadata):
    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=0.5)
    server.set_faults(status=0, count=1, drip=0.3)  # "FALSE": 5 bytes, 1.5 s; every read well within 0.5 s
    t0 = time.monotonic()
    with pytest.raises(MetadataHTTPError, match="timed out") as e:
        client.request("GET", PREEMPTED, FLAVOR)
    assert time.monotonic() - t0 < 1.2  # the request's 0.5 s, not the drip's 1.5 s
    assert not e.value.read_timeout  # an answer came, slowly: not "nothing answers" (AWS's hop-limit hint)
    assert client.request("GET", PREEMPTED, FLAVOR).body == b"FALSE"  # the next request is clean


def test_a_huge_answer_is_refused_without_holding_it_in_memory(mock_metadata):
    server = mock_metadata("gcp")
    client = MetadataClient.from_url(server.url, timeout=10)
    server.set_faults(status=0, count=2, pad=20_000_000)  # "FALSE" and 20 MB of blanks, streamed
    tracemalloc.start()
    try:
        with pytest.raises(MetadataHTTPError, match="20000005 bytes refused"):
            client.request("GET", PREEMPTED, FLAVOR)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak  # not the 20 MB (40 with the copies)
    with pytest.raises(MetadataHTTPError, match="refused"):
        client.request("GET", PREEMPTED, FLAVOR)  # refused each time, never "learnt"
    assert client.request("GET", PREEMPTED, FLAVOR).body == b"FALSE"  # then all is well again


def test_a_huge_answer_without_a_length_is_cut_at_the_limit():
    """A close-delimited answer (no Content-Length) is read up to the limit and no further."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        chunk = b"x" * 65536
        try:
            while not stop.is_set():
                conn.sendall(chunk)
        except OSError:
            pass  # the client hung up: what it should do
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = MetadataClient("127.0.0.1", listener.getsockname()[1], timeout=10, max_body=100_000)
    try:
        with pytest.raises(MetadataHTTPError, match="over 100000 bytes refused"):
            client.request("GET", "/", {})
    finally:
        stop.set()
        thread.join(10)
        listener.close()
    assert not thread.is_alive()
