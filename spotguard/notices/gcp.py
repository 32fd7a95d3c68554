"""Google Cloud notices through the metadata server: a hanging GET on ``instance/preempted``, and
another on ``instance/maintenance-event``, each on its own watcher thread.

GCP gives a Spot/preemptible VM about 30 seconds, so polling once a second would waste a good part
of it. Instead the server holds each request until the value changes (``_hanging.HangingGet``):
detection is as fast as the network. Host maintenance is announced 60 s ahead in
``maintenance-event``: ``TERMINATE_ON_HOST_MAINTENANCE`` is a stop notice,
``MIGRATE_ON_HOST_MAINTENANCE`` an advisory (``migrate``) that triggers an early checkpoint. It
has a hanging GET of its own (``channels()``), so it is seen when it changes, not when the
``preempted`` wait happens to end.

GCP stamps no time on either, so deadlines are counted from the change as far as it can be known:
the last moment the old value was confirmed (a hanging GET that waited confirms it until it
returns). Requests that failed around the change thus shorten the deadline instead of hiding in
it, and the watcher retries fast in the first seconds of a failure (``fast_retry``). An event that
ends (``NONE``) and comes back is a new notice (a second live migration gets its own early
checkpoint); a value that changes within one kind of event is the same notice.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
from collections.abc import Callable

from spotguard.errors import ConfigError

from .. import _env
from ._hanging import HEADERS, ROOT, HangingGet
from ._http import MetadataClient, MetadataProvider
from .base import Notice, NoticeProvider, Report, utcnow

__all__ = ["HEADERS", "ROOT", "GcpMaintenance", "GcpProvider", "endpoint"]

logger = logging.getLogger(__name__)

ENV_HOST = "GCE_METADATA_HOST"  # host:port, as google-auth reads it
DEFAULT_HOST = "169.254.169.254"  # the IP, not metadata.google.internal: no DNS lookup off-cloud
PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
MAINTENANCE_WARNING = 60.0  # seconds GCP gives before a TERMINATE_ON_HOST_MAINTENANCE
PREEMPT_WARNING = 30.0  # seconds a Spot or preemptible VM has after `preempted` flips
#: A value's prefix -> the notice kind it is.
MAINTENANCE_KINDS = {"TERMINATE_ON_HOST_MAINTENANCE": "maintenance", "MIGRATE_ON_HOST_MAINTENANCE": "migrate"}


def endpoint() -> str:
    return "http://" + (os.environ.get(ENV_HOST) or DEFAULT_HOST)


class GcpProvider(MetadataProvider):
    """Watches ``instance/preempted`` (its ``poll()``) and ``instance/maintenance-event`` (the
    ``maintenance`` channel's ``poll()``), each with hanging GETs on a connection of its own.

    ``deadline_seconds``: the time a preempted VM has after the flag flips (default
    ``$SPOTGUARD_GCP_DEADLINE``, else 30 s, as for Spot and preemptible VMs). ``hang``: how long one
    hanging GET may wait (the server's ``timeout_sec``).
    """

    name = "gcp"
    blocking = True
    fast_retry = 3.0  # 503s while `preempted` flips: every second of backoff would come off the 30 s

    def __init__(
        self,
        endpoint_url: str | None = None,
        *,
        timeout: float = 1.0,
        hang: int = 5,
        deadline_seconds: float | None = None,
    ) -> None:
        if hang < 1:
            raise ConfigError(f"hang must be at least 1 second, got {hang}")
        url = endpoint_url or endpoint()
        super().__init__(url, timeout, logger)
        self.timeout = timeout
        if deadline_seconds is None:  # not given: the job's environment decides (`spotguard rehearse` sets it)
            deadline_seconds = _env.seconds(_env.GCP_DEADLINE, default=PREEMPT_WARNING)
        self.deadline_seconds = deadline_seconds
        self._wake = threading.Event()  # set by wakeup(): both channels' waits end
        self._preempted = HangingGet(self.client, PREEMPTED, hang, self._wake, self._warn)
        self._preempt: Notice | None = None
        self.maintenance = GcpMaintenance(MetadataClient.from_url(url, timeout), hang, self._wake, self._warn)

    @property
    def hang(self) -> int:
        return self._preempted.hang

    @hang.setter
    def hang(self, value: int) -> None:
        self._preempted.hang = self.maintenance.watch.hang = value

    def channels(self) -> list[NoticeProvider]:
        return [self, self.maintenance]

    def poll(self) -> Notice | None:
        """Wait on ``instance/preempted`` (at most ``hang`` s); the preempt notice while it is TRUE."""
        reading = self._preempted.read()
        if reading is None:
            return None
        if reading.value == "TRUE":
            if self._preempt is None:
                # The deadline cannot have passed already: this VM still runs.
                deadline = max(reading.since + dt.timedelta(seconds=self.deadline_seconds), utcnow())
                self._preempt = Notice(
                    self.name,
                    "preempt",
                    deadline=deadline,
                    raw={"preempted": reading.value, "etag": self._preempted.etag},
                    event_id="gcp-preempt",
                )
            return self._preempt
        if reading.value != "FALSE":
            self._warn("%s: unexpected value %r; ignored", PREEMPTED, reading.value[:100])
        self._preempt = None
        return None

    def open(self, report: Report) -> None:
        self._wake.clear()  # a watcher may be started again after a stop: from plain GETs
        self._preempted.reset()
        self.maintenance.watch.reset()

    def wakeup(self) -> None:
        self._wake.set()
        self.client.interrupt()
        self.maintenance.client.interrupt()

    def close(self) -> None:
        self.client.close()
        self.maintenance.close()


class GcpMaintenance(NoticeProvider):
    """``instance/maintenance-event``, the second channel of a ``GcpProvider`` (its notices say
    ``gcp``): ``maintenance`` with a deadline 60 s after the change, or ``migrate`` (advisory)."""

    name = "gcp-maintenance"
    blocking = True
    fast_retry = 3.0

    def __init__(self, client: MetadataClient, hang: int, wake: threading.Event, warn: Callable[..., None]) -> None:
        self.client = client
        self.watch = HangingGet(client, MAINTENANCE, hang, wake, warn)
        self._wake, self._warn = wake, warn
        self._current: Notice | None = None  # the event under way
        self._events = 0  # events seen: each one's notice id is new

    def poll(self) -> Notice | None:
        reading = self.watch.read()
        if reading is None:
            return None
        value = reading.value
        if value in ("NONE", ""):
            self._current = None  # ended: the next event is a new notice
            return None
        kind = next((k for prefix, k in MAINTENANCE_KINDS.items() if value.startswith(prefix)), None)
        if kind is None:
            self._warn("%s: unexpected value %r; ignored", MAINTENANCE, value[:100])
            return self._current
        if self._current is not None and self._current.kind == kind:
            return self._current  # the same event, whatever else its value says: the same notice
        self._events += 1
        deadline = None
        if kind == "maintenance":
            deadline = max(reading.since + dt.timedelta(seconds=MAINTENANCE_WARNING), utcnow())
        else:
            logger.info("GCP live migration announced (%s)", value)
        self._current = Notice(
            GcpProvider.name,
            kind,
            deadline=deadline,
            raw={"maintenance-event": value},
            event_id=f"gcp-{kind}-{self._events}",
        )
        return self._current

    def wakeup(self) -> None:
        self._wake.set()
        self.client.interrupt()

    def close(self) -> None:
        self.client.close()
