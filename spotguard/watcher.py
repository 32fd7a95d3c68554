"""The background watcher: one daemon thread per provider (per channel of one), one shared flag.

Why one thread per provider: a GCP hanging GET or a signal queue wait blocks inside ``poll()``,
and must not delay the other sources (nor GCP's other hanging GET: ``NoticeProvider.channels()``).
The watcher owns timing, error logging and backoff; nothing a provider raises ever reaches the
training loop. Checking ``preempted.is_set()`` costs tens of nanoseconds, and ``stop()`` returns
within one interval because every wait is an Event wait.

Backoff after a failed poll is capped near the polling interval (1 s by default): a notice that
appears during a storm of metadata errors must still be seen within about two seconds, and one
poll a second never hammers a metadata service. A provider that asks for it (``fast_retry``, GCP)
is retried every 0.1-0.2 s in the first seconds of a failure. A provider that keeps failing is
reported at WARNING level again every ``warn_every`` seconds, so a lasting problem stays visible.

A source that produces a new advisory notice on every read costs bounded memory and log: the
``advisories`` kept are the latest ``MAX_ADVISORIES``, the notice ids remembered the latest
``MAX_SEEN`` (a notice still being seen stays remembered), and advisories of one provider and kind
are logged at WARNING at most once every ``warn_every`` seconds (DEBUG in between).

When two sources announce the same reclaim (the node's metadata service and Ray's drain), the flag
is raised once and ``notice`` is the stop notice with the earliest deadline; acknowledging it
acknowledges every stop notice seen, each to the source that found it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from spotguard.errors import ConfigError

from . import notices
from .notices import signals
from .notices.base import Notice, NoticeProvider

logger = logging.getLogger(__name__)

# Our own generator: the training's global random streams must never be touched by spotguard.
_jitter = random.Random()
FAST_RETRY = 0.2  # at most this long between retries in the first ``provider.fast_retry`` seconds of a failure
MAX_ADVISORIES = 64  # the latest advisory notices kept in ``Watcher.advisories``
MAX_SEEN = 1024  # notice ids remembered for deduplication (the least recently seen are forgotten)


class Watcher:
    """Watches notice providers in the background and raises ``preempted`` on the first stop notice.

    ``on_notice(notice)`` is called once per distinct notice (advisory ones included) from a
    watcher thread. Advisory notices (``rebalance``, ``migrate``) set ``preempted`` only when
    ``stop_on_advisory`` is True; otherwise they are kept in ``advisories``. ``max_backoff`` caps
    the wait after failed polls (never below ``interval``); ``warn_every`` is how often a provider
    that keeps failing is reported again at WARNING level. ``sigint``: while the watcher runs, the
    first SIGINT (Ctrl-C, or ``spotguard run`` forwarding one) is a stop notice too, whatever the
    providers (``signals.cover_sigint``); what a training loop wants, and what ``Guard`` and the
    trainer integrations ask for. Off by default: a plain watcher leaves Ctrl-C to the program.
    """

    def __init__(
        self,
        providers: str | Iterable[str | NoticeProvider] | None = "auto",
        interval: float = 1.0,
        on_notice: Callable[[Notice], None] | None = None,
        *,
        stop_on_advisory: bool = False,
        max_backoff: float = 1.0,
        warn_every: float = 300.0,
        sigint: bool = False,
    ) -> None:
        if interval <= 0:
            raise ConfigError("interval must be positive")
        if warn_every <= 0:
            raise ConfigError("warn_every must be positive")
        self.providers: list[NoticeProvider] = notices.build(providers)
        if sigint:
            signals.cover_sigint(self.providers)
        self.interval = interval
        self.on_notice = on_notice
        self.stop_on_advisory = stop_on_advisory
        self.max_backoff = max(max_backoff, interval)
        self.warn_every = warn_every
        self.preempted = threading.Event()
        self.notice: Notice | None = None
        self.stops: list[Notice] = []  # every distinct stop notice, in order (at most MAX_ADVISORIES)
        self.advisories: list[Notice] = []
        self._seen: OrderedDict[str, None] = OrderedDict()  # an ordered set: least recently seen first
        self._advised: dict[tuple[str, str], float] = {}  # (provider, kind) -> when last logged at WARNING
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._opened: list[NoticeProvider] = []
        self._channels: list[NoticeProvider] = []

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def start(self) -> Watcher:
        """Open every provider (from this thread) and start polling. Calling it twice is harmless."""
        if self._threads:
            return self
        self._stopping.clear()
        for provider in self.providers:
            try:
                provider.open(self.report)
                channels = provider.channels()
            except Exception:
                logger.exception("notice provider %s failed to open; it will not be watched", provider.name)
                continue
            self._opened.append(provider)
            for channel in channels:
                self._channels.append(channel)
                thread = threading.Thread(
                    target=self._run, args=(channel,), daemon=True, name=f"spotguard-watch-{channel.name}"
                )
                self._threads.append(thread)
                thread.start()
        logger.debug("watching %s every %.2fs", [p.name for p in self._opened], self.interval)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop polling, wait for the threads, and close the providers (from this thread)."""
        self._stopping.set()
        for channel in self._channels:
            try:
                channel.wakeup()
            except Exception:
                logger.debug("wakeup of %s failed", channel.name, exc_info=True)
        join_timeout = timeout if timeout is not None else self.interval + 5.0
        for thread in self._threads:
            thread.join(join_timeout)
            if thread.is_alive():
                logger.warning("watcher thread %s did not stop within %.1fs", thread.name, join_timeout)
        for provider in self._opened:
            try:
                provider.close()
            except Exception:
                logger.warning("closing notice provider %s failed", provider.name, exc_info=True)
        self._threads.clear()
        self._opened.clear()
        self._channels.clear()

    def report(self, notice: Notice) -> None:
        """Deliver a notice as if a provider had found it (also usable by callers and tests)."""
        level = logging.WARNING
        with self._lock:
            if notice.event_id in self._seen:
                self._seen.move_to_end(notice.event_id)  # still seen: never the one forgotten
                return
            self._seen[notice.event_id] = None
            if len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
            stops = self.stop_on_advisory or not notice.advisory
            if stops and _governs(notice, self.notice):
                self.notice = notice
            if stops and len(self.stops) < MAX_ADVISORIES:
                self.stops.append(notice)
            if not stops:
                self.advisories.append(notice)
                del self.advisories[:-MAX_ADVISORIES]
                now, key = time.monotonic(), (notice.provider, notice.kind)
                last = self._advised.get(key)
                if last is not None and now - last < self.warn_every:
                    level = logging.DEBUG  # the same kind of advice again soon: said already
                else:
                    self._advised[key] = now
        left = notice.seconds_left()
        logger.log(
            level,
            "%s notice from %s (%s)%s",
            "stop" if stops else "advisory",
            notice.provider,
            notice.kind,
            "" if left is None else f", deadline in {left:.0f}s",
        )
        if stops:
            self.preempted.set()
        if self.on_notice is not None:
            try:
                self.on_notice(notice)
            except Exception:
                logger.exception("on_notice callback failed for %s", notice.event_id)

    def acknowledge(self, notice: Notice) -> None:
        """Pass ``notice``, and the other stop notices seen with it, back to the providers that found
        them (after the emergency checkpoint: the state is safe for each). Never raises."""
        with self._lock:
            others = [n for n in self.stops if n.event_id != notice.event_id]
        for each in [notice, *others]:
            for provider in self.providers:
                if provider.name == each.provider:
                    try:
                        provider.acknowledge(each)
                    except Exception as e:
                        logger.warning("acknowledging %s to %s failed: %s", each.event_id, provider.name, e)

    def _backoff(self, provider: NoticeProvider, failures: int, outage: float) -> float:
        """Seconds to wait after the ``failures``-th failed poll in a row, ``outage`` seconds into it."""
        if outage < provider.fast_retry:
            step = min(FAST_RETRY, self.interval)
        else:
            step = min(self.max_backoff, self.interval * 2 ** min(failures - 1, 6))
        return step * (0.5 + 0.5 * _jitter.random())  # jitter decorrelates machines, never past the cap

    def _run(self, provider: NoticeProvider) -> None:
        failures, since, warned = 0, 0.0, 0.0
        while not self._stopping.is_set():
            try:
                notice = provider.poll()
            except Exception as e:
                now = time.monotonic()
                if not failures:
                    since = now
                failures += 1
                delay = self._backoff(provider, failures, now - since)
                if failures == 1 or now - warned >= self.warn_every:
                    warned = now
                    logger.warning(
                        "notice provider %s failed%s (%s: %s); retrying in %.2fs",
                        provider.name,
                        f" for {now - since:.0f}s ({failures} polls)" if failures > 1 else "",
                        type(e).__name__,
                        e,
                        delay,
                    )
                else:
                    logger.debug(
                        "notice provider %s failed (%s: %s); retrying in %.2fs",
                        provider.name,
                        type(e).__name__,
                        e,
                        delay,
                    )
                self._stopping.wait(delay)
                continue
            if failures:
                logger.info(
                    "notice provider %s recovered after %d failed polls (%.1fs)",
                    provider.name,
                    failures,
                    time.monotonic() - since,
                )
                failures = 0
            if notice is not None:
                self.report(notice)
            if not provider.blocking:
                self._stopping.wait(self.interval)

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _governs(new: Notice, current: Notice | None) -> bool:
    """Whether stop notice ``new`` replaces ``current`` as the one whose deadline governs: the first one,
    or one with an earlier deadline (a deadline known beats none)."""
    if current is None:
        return True
    return new.deadline is not None and (current.deadline is None or new.deadline < current.deadline)
