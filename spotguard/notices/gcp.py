"""Google Cloud notices through the metadata server, with a hanging GET on ``instance/preempted``.

GCP gives a Spot/preemptible VM about 30 seconds, so polling once a second would waste a good part
of it. Instead ``poll()`` asks the server to hold the request until the value changes
(``?wait_for_change=true&last_etag=E&timeout_sec=N``): detection is as fast as the network. The
first read is a plain GET, which yields the current value and its ETag. ``maintenance-event`` is
read with a plain GET on every round (GCP announces host maintenance 60 s ahead):
``TERMINATE_ON_HOST_MAINTENANCE`` is a stop notice, ``MIGRATE_ON_HOST_MAINTENANCE`` an advisory
(``migrate``) that triggers an early checkpoint.

GCP stamps no time on a preemption, so the 30 s are counted from the flip as far as it can be
known: the last moment ``FALSE`` was confirmed (a hanging GET that waited confirms it until it
returns). Requests that failed around the flip thus shorten the deadline instead of hiding in it,
and the watcher retries fast in the first seconds of a failure (``fast_retry``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time

from spotguard.errors import ConfigError

from .. import _env
from ._http import MetadataProvider, check_status
from .base import Notice, Report, utcnow

logger = logging.getLogger(__name__)

ENV_HOST = "GCE_METADATA_HOST"  # host:port, as google-auth reads it
DEFAULT_HOST = "169.254.169.254"  # the IP, not metadata.google.internal: no DNS lookup off-cloud
ROOT = "/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
MAINTENANCE_WARNING = 60.0  # seconds GCP gives before a TERMINATE_ON_HOST_MAINTENANCE
PREEMPT_WARNING = 30.0  # seconds a Spot or preemptible VM has after `preempted` flips
#: A hanging GET that took longer than this really waited: the server held FALSE until it answered.
_WAITED = 0.25


def endpoint() -> str:
    return "http://" + (os.environ.get(ENV_HOST) or DEFAULT_HOST)


class GcpProvider(MetadataProvider):
    """Watches ``instance/preempted`` (hanging GET) and ``instance/maintenance-event``.

    ``deadline_seconds``: the time a preempted VM has after the flag flips (30 s for Spot and
    preemptible VMs). ``hang``: how long one hanging GET may wait (the server's ``timeout_sec``).
    """

    name = "gcp"
    blocking = True
    fast_retry = 3.0  # 503s while `preempted` flips: every second of backoff would come off the 30 s

    @classmethod
    def from_env(cls) -> GcpProvider:
        """Built by name (``providers="auto"``, ``--providers gcp``): ``$SPOTGUARD_GCP_DEADLINE`` seconds."""
        return cls(deadline_seconds=_env.seconds(_env.GCP_DEADLINE, default=PREEMPT_WARNING))

    def __init__(
        self,
        endpoint_url: str | None = None,
        *,
        timeout: float = 1.0,
        hang: int = 5,
        deadline_seconds: float = PREEMPT_WARNING,
    ) -> None:
        if hang < 1:
            raise ConfigError(f"hang must be at least 1 second, got {hang}")
        super().__init__(endpoint_url or endpoint(), timeout, logger)
        self.timeout = timeout
        self.hang = hang
        self.deadline_seconds = deadline_seconds
        self._etag: str | None = None
        self._last_read: float | None = None  # monotonic; reads without an ETag are paced from it
        self._false_at: dt.datetime | None = None  # the last moment `preempted` was known FALSE
        self._preempt: Notice | None = None
        self._maintenance: tuple[str, Notice] | None = None
        self._wake = threading.Event()

    def _get(self, path: str, query: str = "", timeout: float | None = None) -> tuple[str, str | None]:
        resp = self.client.request("GET", ROOT + path + query, HEADERS, timeout=timeout)
        check_status(resp.status, (200,), f"GET {ROOT}{path}")
        if resp.headers.get("metadata-flavor") != "Google":
            raise ValueError(f"{self.client.base_url} answered without 'Metadata-Flavor: Google': not GCP")
        return resp.text.strip(), resp.headers.get("etag")

    def poll(self) -> Notice | None:
        started = time.monotonic()
        if self._etag is None:
            if self._last_read is not None:  # no ETag, no hanging GET: a read a second, never a busy loop
                self._wake.wait(max(0.0, self._last_read + 1.0 - started))
            value, etag = self._get(PREEMPTED)
            waited = False
        else:
            query = f"?wait_for_change=true&last_etag={self._etag}&timeout_sec={self.hang}"
            try:
                value, etag = self._get(PREEMPTED, query, timeout=self.hang + self.timeout + 1.0)
            except OSError:
                if self._wake.is_set():
                    return None  # interrupted by wakeup(): the watcher is stopping
                raise
            took = time.monotonic() - started
            waited = took >= _WAITED
            if etag == self._etag and not waited:
                # A server that ignores wait_for_change must not turn this thread into a busy loop.
                self._wake.wait(1.0 - took)
        self._last_read = time.monotonic()
        self._etag = etag or None
        preempt = self._preempted(value, etag, waited)
        try:
            maintenance = self._check_maintenance()
        except OSError:
            if preempt is not None:
                return preempt  # a failing second read must not hide the preemption just seen
            raise
        return preempt or maintenance

    def _preempted(self, value: str, etag: str | None, waited: bool) -> Notice | None:
        now = utcnow()
        if value == "TRUE":
            if self._preempt is None:
                # The flip happened after FALSE was last known; a hanging GET that waited knew it
                # until it returned. The deadline cannot have passed already: this VM still runs.
                flip = now if waited or self._false_at is None else self._false_at
                deadline = max(flip + dt.timedelta(seconds=self.deadline_seconds), now)
                self._preempt = Notice(
                    self.name,
                    "preempt",
                    deadline=deadline,
                    raw={"preempted": value, "etag": etag},
                    event_id="gcp-preempt",
                )
            return self._preempt
        if value == "FALSE":
            self._false_at = now
        else:
            self._warn("%s: unexpected value %r; ignored", PREEMPTED, value[:100])
        self._preempt = None
        return None

    def _check_maintenance(self) -> Notice | None:
        value, _ = self._get(MAINTENANCE)
        if value in ("NONE", ""):
            self._maintenance = None
            return None
        if self._maintenance is not None and self._maintenance[0] == value:
            return self._maintenance[1]  # same event: same notice, same deadline
        if value.startswith("TERMINATE_ON_HOST_MAINTENANCE"):
            notice = Notice(
                self.name,
                "maintenance",
                deadline=utcnow() + dt.timedelta(seconds=MAINTENANCE_WARNING),
                raw={"maintenance-event": value},
            )
        elif value.startswith("MIGRATE_ON_HOST_MAINTENANCE"):
            logger.info("GCP live migration announced (%s)", value)
            notice = Notice(self.name, "migrate", raw={"maintenance-event": value})
        else:
            self._warn("%s: unexpected value %r; ignored", MAINTENANCE, value[:100])
            return None
        self._maintenance = (value, notice)
        return notice

    def open(self, report: Report) -> None:
        self._wake.clear()  # a watcher may be started again after a stop

    def wakeup(self) -> None:
        self._wake.set()
        self.client.interrupt()

    def close(self) -> None:
        self.client.close()
