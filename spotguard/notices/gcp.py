"""Google Cloud notices through the metadata server, with a hanging GET on ``instance/preempted``.

GCP gives a Spot/preemptible VM about 30 seconds, so polling once a second would waste a good part
of it. Instead ``poll()`` asks the server to hold the request until the value changes
(``?wait_for_change=true&last_etag=E&timeout_sec=N``): detection is as fast as the network. The
first read is a plain GET, which yields the current value and its ETag. ``maintenance-event`` is
read with a plain GET on every round (GCP announces host maintenance 60 s ahead):
``TERMINATE_ON_HOST_MAINTENANCE`` is a stop notice, ``MIGRATE_ON_HOST_MAINTENANCE`` an advisory
(``migrate``) that triggers an early checkpoint.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time

from .. import _env
from ._http import MetadataClient, WarnOnce, check_status
from .base import Notice, NoticeProvider, Report, utcnow

logger = logging.getLogger(__name__)

ENV_HOST = "GCE_METADATA_HOST"  # host:port, as google-auth reads it
DEFAULT_HOST = "169.254.169.254"  # the IP, not metadata.google.internal: no DNS lookup off-cloud
ROOT = "/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
MAINTENANCE_WARNING = 60.0  # seconds GCP gives before a TERMINATE_ON_HOST_MAINTENANCE
PREEMPT_WARNING = 30.0  # seconds a Spot or preemptible VM has after `preempted` flips


def endpoint() -> str:
    return "http://" + (os.environ.get(ENV_HOST) or DEFAULT_HOST)


class GcpProvider(NoticeProvider):
    """Watches ``instance/preempted`` (hanging GET) and ``instance/maintenance-event``.

    ``deadline_seconds``: the time a preempted VM has after the flag flips (30 s for Spot and
    preemptible VMs). ``hang``: how long one hanging GET may wait (the server's ``timeout_sec``).
    """

    name = "gcp"
    blocking = True

    @classmethod
    def from_env(cls) -> GcpProvider:
        """Built by name (``providers="auto"``, ``--providers gcp``): ``$SPOTGUARD_GCP_DEADLINE`` seconds."""
        return cls(deadline_seconds=_env.seconds(_env.GCP_DEADLINE, default=PREEMPT_WARNING))

    def __init__(self, endpoint_url: str | None = None, *, timeout: float = 1.0, hang: int = 5,
                 deadline_seconds: float = PREEMPT_WARNING) -> None:
        if hang < 1:
            raise ValueError(f"hang must be at least 1 second, got {hang}")
        self.client = MetadataClient.from_url(endpoint_url or endpoint(), timeout)
        self._warn = WarnOnce(logger)
        self.timeout = timeout
        self.hang = hang
        self.deadline_seconds = deadline_seconds
        self._etag: str | None = None
        self._polled = False  # the first read is immediate; later reads without an ETag are paced
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
            if self._polled:  # no ETag, so no hanging GET: poll once a second, never in a busy loop
                self._wake.wait(1.0)
            value, etag = self._get(PREEMPTED)
            self._polled = True
        else:
            query = f"?wait_for_change=true&last_etag={self._etag}&timeout_sec={self.hang}"
            try:
                value, etag = self._get(PREEMPTED, query, timeout=self.hang + self.timeout + 1.0)
            except OSError:
                if self._wake.is_set():
                    return None  # interrupted by wakeup(): the watcher is stopping
                raise
            if etag == self._etag and time.monotonic() - started < 0.2:
                # A server that ignores wait_for_change must not turn this thread into a busy loop.
                self._wake.wait(1.0)
        self._etag = etag or None
        preempt = self._preempted(value, etag)
        try:
            maintenance = self._check_maintenance()
        except OSError:
            if preempt is not None:
                return preempt  # a failing second read must not hide the preemption just seen
            raise
        return preempt or maintenance

    def _preempted(self, value: str, etag: str | None) -> Notice | None:
        if value == "TRUE":
            if self._preempt is None:
                deadline = utcnow() + dt.timedelta(seconds=self.deadline_seconds)
                self._preempt = Notice(self.name, "preempt", deadline=deadline,
                                       raw={"preempted": value, "etag": etag})
            return self._preempt
        if value != "FALSE":
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
            notice = Notice(self.name, "maintenance",
                            deadline=utcnow() + dt.timedelta(seconds=MAINTENANCE_WARNING),
                            raw={"maintenance-event": value})
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
