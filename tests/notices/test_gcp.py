"""The GCP provider against the mock metadata server over real HTTP (and google-auth against the mock)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

from spotguard import Watcher, notices
from spotguard.notices._http import MetadataHTTPError
from spotguard.notices.gcp import GcpProvider
from spotguard.ops.mockmeta import endpoint_env

from ..helpers import subprocess_env


def poll_in_thread(p: GcpProvider) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append((p.poll(), time.monotonic())))
    thread.start()
    return thread, out


def test_first_poll_reads_at_once_then_a_hanging_get_waits_for_a_change(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=3)  # margins that a loaded 2-core machine cannot eat
    t0 = time.monotonic()
    assert p.poll() is None
    assert time.monotonic() - t0 < 2.5  # the first read does not hang
    t0 = time.monotonic()
    assert p.poll() is None  # no change: the server held the request for timeout_sec
    assert 2.9 < time.monotonic() - t0 < 13


def test_preemption_is_seen_as_soon_as_it_happens_with_a_30s_deadline(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=30)
    p.poll()
    thread, out = poll_in_thread(p)
    time.sleep(0.3)
    triggered = time.monotonic()
    server.mock.trigger("preempt")
    thread.join(15)
    notice, returned = out[0]
    assert returned - triggered < 5  # not the 30 s hang: the hanging GET returned on the change
    assert notice.kind == "preempt" and not notice.advisory
    assert 28 < notice.seconds_left() + (time.monotonic() - returned) <= 30.5  # 30 s from when it was seen
    p.hang = 1
    assert p.poll() is notice  # still preempted: the same notice, the same deadline


def test_provider_built_by_name_takes_its_deadline_from_spotguard_gcp_deadline(mock_metadata, monkeypatch):
    server = mock_metadata("gcp")
    monkeypatch.setenv("GCE_METADATA_HOST", endpoint_env("gcp", server.url)["GCE_METADATA_HOST"])
    monkeypatch.setenv("SPOTGUARD_GCP_DEADLINE", "90")
    server.mock.trigger("preempt")
    notice = notices.build("gcp")[0].poll()
    assert notice.kind == "preempt" and 88 < notice.seconds_left() <= 90


def test_a_change_before_the_hanging_get_starts_is_not_missed(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=30)
    p.poll()
    server.mock.trigger("preempt")  # between two polls: last_etag differs, the GET returns at once
    t0 = time.monotonic()
    assert p.poll().kind == "preempt"
    assert time.monotonic() - t0 < 10  # not the 30 s hang


def test_host_maintenance_terminate_stops_and_migrate_is_advisory(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=1)
    p.poll()
    server.mock.trigger("migrate")
    notice = p.maintenance.poll()
    assert notice.kind == "migrate" and notice.advisory and notice.provider == "gcp"
    server.mock.trigger("maintenance")
    notice = p.maintenance.poll()
    assert notice.kind == "maintenance" and 55 < notice.seconds_left() <= 60


def test_unexpected_values_are_logged_not_stops(mock_metadata, caplog):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=1)
    server.mock.values["instance/preempted"] = "MAYBE"
    server.mock.values["instance/maintenance-event"] = "SOMETHING_NEW"
    with caplog.at_level(logging.WARNING, "spotguard.notices.gcp"):
        assert p.poll() is None and p.maintenance.poll() is None
    assert "MAYBE" in caplog.text and "SOMETHING_NEW" in caplog.text


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_raise_for_the_watcher_to_back_off(mock_metadata, status):
    server = mock_metadata("gcp")
    server.set_faults(status=status, count=1)
    with pytest.raises(MetadataHTTPError, match=str(status)):
        GcpProvider(server.url).poll()


def test_a_server_that_is_not_google_is_refused(mock_metadata):
    server = mock_metadata("azure")  # answers, but without Metadata-Flavor: Google
    with pytest.raises(OSError):
        GcpProvider(server.url).poll()


def test_watcher_stop_interrupts_a_hanging_get_at_once(mock_metadata):
    server = mock_metadata("gcp")
    watcher = Watcher([GcpProvider(server.url, hang=60)], interval=1.0).start()
    time.sleep(0.3)  # first read done, now hanging
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 10  # not the 60 s hang
    assert not watcher.running


def test_watcher_reports_a_preemption_once(mock_metadata):
    server = mock_metadata("gcp")
    seen = []
    with Watcher([GcpProvider(server.url, hang=1)], interval=1.0, on_notice=seen.append) as watcher:
        time.sleep(0.2)
        server.mock.trigger("preempt")
        assert watcher.preempted.wait(10)
        time.sleep(0.2)
    assert [n.kind for n in seen] == ["preempt"]


GOOGLE_AUTH = """
import json, sys
import google.auth.transport.requests as tr
from google.auth.compute_engine import _metadata
request = tr.Request()
print(json.dumps({"ping": _metadata.ping(request, timeout=2, retry_count=1),
                  "preempted": _metadata.get(request, "instance/preempted", retry_count=1),
                  "zone": _metadata.get(request, "instance/zone", retry_count=1),
                  "project": _metadata.get(request, "project/project-id", retry_count=1)}))
"""


def test_google_auth_recognises_and_reads_the_mock(mock_metadata):
    server = mock_metadata("gcp")
    env = subprocess_env(**endpoint_env("gcp", server.url))  # google-auth reads them at import time

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", GOOGLE_AUTH], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = run()
    assert first["ping"] is True and first["preempted"] == "FALSE"
    assert first["zone"].endswith("/zones/us-central1-a") and first["project"] == "mock-project"
    server.mock.trigger("preempt")
    assert run()["preempted"] == "TRUE"


def test_a_preemption_survives_a_failing_maintenance_read(mock_metadata):
    server = mock_metadata("gcp")
    original = server.mock.handle
    server.mock.handle = lambda req: type(original(req))(503) if "maintenance" in req.path else original(req)
    with Watcher([GcpProvider(server.url, hang=30)], interval=1.0) as watcher:
        time.sleep(0.3)  # the preempted channel hangs; the maintenance one fails and backs off
        server.mock.trigger("preempt")
        assert watcher.preempted.wait(5)  # not the 30 s hang


def test_watching_never_draws_from_the_global_random_generators(mock_metadata):
    import random

    import numpy as np
    import torch

    server = mock_metadata("gcp", error_rate=0.3)  # errors too: the watcher's backoff jitter runs
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with Watcher([GcpProvider(server.url, hang=1)], interval=0.05, max_backoff=0.05) as watcher:
        time.sleep(0.5)
        server.mock.trigger("preempt")
        assert watcher.preempted.wait(10)
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all() and torch.equal(torch.get_rng_state(), before[2])


def test_a_server_without_etags_is_polled_once_a_second_not_in_a_busy_loop():
    """A metadata proxy that drops ETags gives no hanging GET: the provider must pace itself."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: list[str] = []

    class NoEtag(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            body = b"NONE" if "maintenance" in self.path else b"FALSE"
            self.send_response(200)
            for k, v in (
                ("Metadata-Flavor", "Google"),
                ("Content-Type", "application/text"),
                ("Content-Length", str(len(body))),
            ):
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoEtag)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Watcher([GcpProvider(f"http://127.0.0.1:{server.server_port}")], interval=1.0) as w:
            time.sleep(2.5)
            assert not w.preempted.is_set()
    finally:
        server.shutdown()
    reads = [h for h in hits if "preempted" in h]
    assert 1 <= len(reads) <= 5, len(reads)  # about one a second; a busy loop makes hundreds


# -- issue 17: the 30 s are counted from the flip; errors around it cost no backoff ---------------
def test_the_deadline_counts_from_the_last_moment_preempted_was_known_false(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=1)
    assert p.poll() is None
    known_false = time.monotonic()
    server.set_faults(status=503, count=1)
    with pytest.raises(MetadataHTTPError):
        p.poll()  # the hanging GET fails while the flag flips
    server.mock.trigger("preempt")
    time.sleep(1.5)  # more failures, or a long backoff
    notice = p.poll()
    assert notice.kind == "preempt"
    assert notice.seconds_left() <= 30 - (time.monotonic() - known_false) + 0.3  # not 30 s from now


def test_a_hanging_get_that_waited_for_the_flip_gives_the_full_30s(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=30)
    p.poll()
    time.sleep(1.0)  # long after the last FALSE: the hanging GET below knows FALSE until the flip
    before = server.mock.requests
    thread, out = poll_in_thread(p)
    while server.mock.requests == before:  # the hanging GET is held by the server
        time.sleep(0.005)
    time.sleep(2.0)  # counted from the GET's start, the deadline would be 2 s short
    triggered = time.monotonic()
    server.mock.trigger("preempt")
    thread.join(15)
    notice = out[0][0]
    from_trigger = notice.seconds_left() + (time.monotonic() - triggered)  # the time to the deadline at the flip
    assert 29.2 < from_trigger <= 35, from_trigger  # 30 s from the flip (plus the delay to learn it on a busy box)


def test_503s_while_preempted_flips_are_retried_fast(mock_metadata):
    server = mock_metadata("gcp")
    seen = []
    with Watcher(
        [GcpProvider(server.url, hang=1)], interval=1.0, on_notice=lambda n: seen.append((n, time.monotonic()))
    ) as watcher:
        time.sleep(0.3)  # first read done; a hanging GET is held
        server.set_faults(status=503, count=6)
        while server._faults["count"] == 6:  # the held GET returns; the next request gets a 503
            time.sleep(0.005)
        flipped = time.monotonic()
        server.mock.trigger("preempt")
        assert watcher.preempted.wait(10)
    notice, at = seen[0]
    assert at - flipped < 8, at - flipped  # 5 more 503s: fast retries, not 1+2+4+5+5 s of backoff
    assert notice.seconds_left() <= 30 - (at - flipped) + 0.2


# -- issue 22: hostile ETags and values; maintenance-event watched on its own ----------------------
def test_an_etag_with_spaces_and_odd_characters_keeps_the_hanging_get_working(mock_metadata):
    """A space in an ETag made every later hanging GET fail (InvalidURL): the preemption was never seen."""
    server = mock_metadata("gcp", etag_prefix='W/ "odd etag" &last_etag=x#%')
    p = GcpProvider(server.url, hang=2)
    assert p.poll() is None
    t0 = time.monotonic()
    assert p.poll() is None  # a hanging GET the server held: the ETag went back intact
    assert time.monotonic() - t0 > 1.8
    with Watcher([GcpProvider(server.url, hang=2)], interval=1.0) as watcher:
        time.sleep(0.5)
        server.mock.trigger("preempt")
        assert watcher.preempted.wait(5)


def test_an_etag_that_cannot_be_sent_back_gives_reads_once_a_second(mock_metadata, caplog):
    server = mock_metadata("gcp", etag_prefix="x" * 300)
    p = GcpProvider(server.url, hang=30)
    with caplog.at_level(logging.WARNING, "spotguard.notices"):
        t0 = time.monotonic()
        for _ in range(3):
            assert p.poll() is None
    assert 1.8 < time.monotonic() - t0 < 10  # plain GETs a second apart, not 30 s hangs nor a busy loop
    assert caplog.text.count("unusable ETag") == 1
    server.mock.trigger("preempt")
    assert p.poll().kind == "preempt"


def test_maintenance_has_its_own_hanging_get_and_its_deadline_counts_from_the_change(mock_metadata):
    """It was read only between hanging GETs on ``preempted``: seen up to ``hang`` s late."""
    server = mock_metadata("gcp")
    seen = []
    with Watcher(
        [GcpProvider(server.url, hang=5)], interval=1.0, on_notice=lambda n: seen.append((n, time.monotonic()))
    ) as watcher:
        time.sleep(0.8)  # both first reads done; both hanging GETs held
        changed = time.monotonic()
        server.mock.trigger("maintenance")
        assert watcher.preempted.wait(10)
    notice, at = seen[0]
    assert notice.kind == "maintenance" and at - changed < 1.5, at - changed  # not at the end of a 5 s hang
    from_change = notice.seconds_left() + (time.monotonic() - changed)
    assert 59.5 < from_change <= 60.3 + (at - changed), from_change  # 60 s from the change (as it was learnt)


def test_a_maintenance_deadline_counts_from_the_last_read_before_a_failure(mock_metadata):
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=30)
    assert p.maintenance.poll() is None
    known_none = time.monotonic()
    server.set_faults(status=503, count=1)
    with pytest.raises(MetadataHTTPError):
        p.maintenance.poll()
    server.mock.trigger("maintenance")
    time.sleep(1.5)  # failures, backoff: the change happened somewhere in here
    notice = p.maintenance.poll()
    assert notice.kind == "maintenance" and notice.provider == "gcp"
    assert notice.seconds_left() <= 60 - (time.monotonic() - known_none) + 0.3  # not 60 s from now


def test_a_second_live_migration_is_a_new_notice(mock_metadata):
    server = mock_metadata("gcp")
    seen = []
    with Watcher([GcpProvider(server.url, hang=2)], interval=1.0, on_notice=seen.append) as watcher:
        time.sleep(0.5)
        for _ in range(2):  # MIGRATE, NONE, MIGRATE
            count = len(seen)
            server.mock.trigger("migrate")
            deadline = time.monotonic() + 5
            while len(seen) == count and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            server.mock.clear()
            time.sleep(0.3)
        assert not watcher.preempted.is_set()
    assert [n.kind for n in seen] == ["migrate", "migrate"]
    assert seen[0].event_id != seen[1].event_id
    assert watcher.advisories == seen


def test_a_maintenance_value_that_changes_on_every_read_is_one_notice_and_one_warning(mock_metadata, caplog):
    server = mock_metadata("gcp")
    original, reads = server.mock.handle, [0]

    def restamping(req):
        if req.path.endswith("/maintenance-event"):
            with server.mock.cond:
                reads[0] += 1
                server.mock.values["instance/maintenance-event"] = f"MIGRATE_ON_HOST_MAINTENANCE_{reads[0]}"
        return original(req)

    server.mock.handle = restamping
    with caplog.at_level(logging.WARNING, "spotguard"), Watcher([GcpProvider(server.url, hang=1)]) as watcher:
        time.sleep(3.0)
    assert len(watcher.advisories) == 1
    assert caplog.text.count("advisory notice") == 1
    assert reads[0] <= 6, reads[0]  # about one read a second, not a busy loop of immediate answers


def test_both_gcp_watcher_threads_stop_at_once(mock_metadata):
    server = mock_metadata("gcp")
    watcher = Watcher([GcpProvider(server.url, hang=60)], interval=1.0).start()
    names = sorted(t.name for t in watcher._threads)
    assert names == ["spotguard-watch-gcp", "spotguard-watch-gcp-maintenance"]
    time.sleep(0.5)  # both hanging
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 3  # not the 60 s hangs
    assert not any(t.name.startswith("spotguard-watch-gcp") for t in threading.enumerate())
    watcher.start()  # and a watcher started again watches again
    time.sleep(0.3)
    server.mock.trigger("migrate")
    time.sleep(1.0)
    watcher.stop()
    assert [n.kind for n in watcher.advisories] == ["migrate"]


def test_a_watcher_started_again_reads_afresh_not_on_an_old_etag(mock_metadata):
    """The value may have changed and changed back while nobody watched: a hanging GET on the old
    ETag would wait out its whole ``hang`` on a notice that is there."""
    server = mock_metadata("gcp")
    p = GcpProvider(server.url, hang=5)
    with Watcher([p]) as first:
        time.sleep(0.3)
        server.mock.trigger("preempt")
        assert first.preempted.wait(5)
    server.mock.clear()
    server.mock.trigger("preempt")  # TRUE again: the ETag the provider last read
    t0 = time.monotonic()
    with Watcher([p]) as second:
        assert second.preempted.wait(10)
    assert time.monotonic() - t0 < 2.0, time.monotonic() - t0
