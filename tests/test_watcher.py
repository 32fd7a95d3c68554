"""The watcher: never raises into training, retries failing providers, dedups, stops promptly."""

from __future__ import annotations

import logging
import threading
import time

from spotguard import Notice, NoticeProvider, Watcher


class Scripted(NoticeProvider):
    """A provider that replays a script of results: a Notice, None, or an exception to raise."""

    name = "scripted"

    def __init__(self, script):
        self.script = list(script)
        self.polls = 0
        self.closed = False

    def poll(self):
        self.polls += 1
        item = self.script.pop(0) if self.script else None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.closed = True


def test_provider_errors_are_logged_and_retried_not_raised(caplog):
    caplog.set_level(logging.INFO, logger="spotguard")
    notice = Notice("scripted", "terminate", raw={"n": 1})
    p = Scripted([RuntimeError("metadata 500"), ValueError("bad json"), notice])
    with Watcher([p], interval=0.01, max_backoff=0.05) as w:
        assert w.preempted.wait(5)
    assert w.notice == notice and p.polls >= 3
    assert "metadata 500" in caplog.text and "recovered" in caplog.text


def test_same_notice_seen_many_times_is_one_event():
    calls = []
    n = Notice("scripted", "terminate", raw={"id": "x"})
    p = Scripted([n, Notice("scripted", "terminate", raw={"id": "x"}), n, None])
    with Watcher([p], interval=0.01, on_notice=calls.append) as w:
        assert w.preempted.wait(5)
        time.sleep(0.1)
    assert len(calls) == 1


def test_advisory_notice_does_not_stop_unless_asked():
    adv = Notice("scripted", "rebalance", raw={})
    with Watcher([Scripted([adv])], interval=0.01) as w:
        time.sleep(0.2)
        assert not w.preempted.is_set() and w.advisories == [adv]
    with Watcher([Scripted([adv])], interval=0.01, stop_on_advisory=True) as w:
        assert w.preempted.wait(5) and w.notice == adv


def test_callback_errors_do_not_kill_the_watcher(caplog):
    def boom(n):
        raise RuntimeError("callback bug")

    p = Scripted([Notice("scripted", "terminate")])
    with Watcher([p], interval=0.01, on_notice=boom) as w:
        assert w.preempted.wait(5)
        time.sleep(0.05)
        assert w.running
    assert "callback bug" in caplog.text


def test_watcher_threads_stop_within_one_interval():
    p = Scripted([])
    w = Watcher([p, "signal"], interval=5.0).start()
    time.sleep(0.1)
    t0 = time.monotonic()
    w.stop()
    took = time.monotonic() - t0
    assert took < 2.5, took  # woken at once, not at the next poll 5 s away
    assert not w.running and p.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("spotguard-watch")]


def test_a_provider_that_fails_to_open_is_skipped(caplog):
    class Broken(Scripted):
        def open(self, report):
            raise OSError("no such device")

    good = Scripted([Notice("scripted", "stop", raw=2)])
    with Watcher([Broken([]), good], interval=0.01) as w:
        assert w.preempted.wait(5)
    assert "failed to open" in caplog.text


def test_backoff_after_failures_never_exceeds_about_a_second():
    """A notice that appears while a provider fails must not wait out seconds of backoff (issue 17)."""
    fast = Scripted([])
    fast.fast_retry = 3.0
    w = Watcher([Scripted([]), fast], interval=1.0)
    slow_delays = [w._backoff(w.providers[0], failures, 60.0) for failures in range(1, 30) for _ in range(50)]
    assert max(slow_delays) <= 1.0 and min(slow_delays) >= 0.5
    assert max(w._backoff(fast, 5, 1.0) for _ in range(200)) <= 0.2  # first seconds of an outage: fast
    assert min(w._backoff(fast, 5, 3.5) for _ in range(200)) >= 0.5


def test_sigint_is_a_stop_notice_when_asked_and_left_alone_otherwise():
    """Guard and the trainer integrations ask for it (Ctrl-C, or `spotguard run` forwarding one); a
    plain watcher leaves Ctrl-C to the program."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    with Watcher([Scripted([])], interval=0.05) as w:
        assert signal.getsignal(signal.SIGINT) is before
    with Watcher([Scripted([])], interval=0.05, sigint=True) as w:
        signal.raise_signal(signal.SIGINT)
        assert w.preempted.wait(5) and w.notice is not None and w.notice.raw == {"signal": "SIGINT"}
    assert signal.getsignal(signal.SIGINT) is before


def test_a_new_advisory_on_every_poll_keeps_memory_and_warnings_bounded(caplog):
    """Issue 22: a source whose advice changes on every read grew the list and the WARNINGs forever."""
    from spotguard.watcher import MAX_ADVISORIES, MAX_SEEN

    class EverNew(Scripted):
        def poll(self):
            self.polls += 1
            return Notice("scripted", "rebalance", raw={"n": self.polls})

    steady = Notice("scripted", "migrate", raw={"steady": True})
    seen = []
    w = Watcher([], on_notice=seen.append)
    with caplog.at_level(logging.WARNING, "spotguard.watcher"):
        for n in range(3 * MAX_SEEN):
            w.report(Notice("scripted", "rebalance", raw={"n": n}))
            w.report(steady)  # seen all along: never forgotten, never reported twice
    assert len(w.advisories) == MAX_ADVISORIES and w.advisories[-1].raw == {"n": 3 * MAX_SEEN - 1}
    assert len(w._seen) <= MAX_SEEN
    assert seen.count(steady) == 1 and len(seen) == 3 * MAX_SEEN + 1  # each new one still reaches the callback
    assert [r.getMessage().split(" (")[1] for r in caplog.records] == ["rebalance)", "migrate)"]  # one each
    caplog.clear()
    p = EverNew([])
    with caplog.at_level(logging.WARNING, "spotguard.watcher"), Watcher([p], interval=0.001) as w:
        while p.polls < 500:
            time.sleep(0.01)
    assert len(w.advisories) == MAX_ADVISORIES and caplog.text.count("advisory notice") == 1
