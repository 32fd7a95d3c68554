"""Azure notices through Scheduled Events (``/metadata/scheduledevents``) of the instance metadata service.

A ``Preempt`` (Spot eviction, about 30 s ahead) or ``Terminate`` event whose ``Resources`` name this
VM is a stop notice with its ``NotBefore`` as the deadline. The document's ``DocumentIncarnation``
changes whenever the event list does, so an unchanged document is not parsed again. Once the
emergency checkpoint is committed, Guard calls ``acknowledge()``, which approves the event
(``StartRequests``) so Azure need not wait for ``NotBefore``: the replacement comes sooner.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import logging
import os
import threading
from typing import Any

from .. import _env
from ._http import MetadataClient, WarnOnce, check_status
from .base import Notice, NoticeProvider, utcnow

logger = logging.getLogger(__name__)

ENV_ENDPOINT = "SPOTGUARD_AZURE_METADATA_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
API_VERSION = "2020-07-01"
EVENTS = f"/metadata/scheduledevents?api-version={API_VERSION}"
VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}
STOP_TYPES = {"Preempt": "preempt", "Terminate": "terminate"}
DEFAULT_WARNING = dt.timedelta(seconds=30)


def endpoint() -> str:
    return os.environ.get(ENV_ENDPOINT) or DEFAULT_ENDPOINT


def parse_rfc1123(value: str) -> dt.datetime:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> aware UTC datetime (ValueError when unusable)."""
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"not an RFC 1123 date: {value!r}") from e
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc)


class AzureProvider(NoticeProvider):
    """Watches Azure Scheduled Events. ``ack=False`` opts out of approving events after a checkpoint."""

    name = "azure"

    @classmethod
    def from_env(cls) -> AzureProvider:
        """Built by name (``providers="auto"``, ``--providers azure``): ``$SPOTGUARD_AZURE_ACK=0`` opts out."""
        return cls(ack=_env.flag(_env.AZURE_ACK, default=True))

    def __init__(self, endpoint_url: str | None = None, *, timeout: float = 1.0, ack: bool = True,
                 vm_name: str | None = None) -> None:
        self.client = MetadataClient.from_url(endpoint_url or endpoint(), timeout)
        self._warn = WarnOnce(logger)
        self.ack = ack
        self.vm_name = vm_name
        self.incarnation: int | None = None
        self.acknowledged: list[str] = []
        self._current: Notice | None = None
        self._lock = threading.Lock()  # poll() and acknowledge() come from different threads

    def _request(self, method: str, path: str, body: bytes | None = None) -> str:
        with self._lock:
            headers = dict(HEADERS, **({"Content-Type": "application/json"} if body else {}))
            resp = self.client.request(method, path, headers, body)
        check_status(resp.status, (200,), f"{method} {path.partition('?')[0]}")
        return resp.text

    def poll(self) -> Notice | None:
        if self.vm_name is None:
            self.vm_name = self._request("GET", VM_NAME).strip()
        text = self._request("GET", EVENTS)
        try:
            doc = json.loads(text)
            incarnation = int(doc["DocumentIncarnation"])
            events = doc.get("Events") or []
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
        except (ValueError, TypeError, KeyError) as e:
            self._warn("scheduled events: malformed document (%s: %s) %r; ignored",
                           type(e).__name__, e, text[:200])
            return self._current
        if incarnation != self.incarnation:
            self.incarnation = incarnation
            self._current = self._find(events)
        return self._current

    def _find(self, events: list[Any]) -> Notice | None:
        mine = (self.vm_name or "").lower()
        for event in events:
            if not isinstance(event, dict):
                continue
            kind = STOP_TYPES.get(str(event.get("EventType")))
            resources = [str(r).lower() for r in event.get("Resources") or []]
            if kind is None:
                if event.get("EventType"):
                    logger.info("scheduled %s event %s (not a stop)", event.get("EventType"), event.get("EventId"))
                continue
            if mine not in resources:
                continue
            not_before = str(event.get("NotBefore") or "")
            if not not_before or event.get("EventStatus") == "Started":
                deadline = utcnow()  # already started: no time left to wait for
            else:
                try:
                    deadline = parse_rfc1123(not_before)
                except ValueError:
                    deadline = utcnow() + DEFAULT_WARNING
                    self._warn("scheduled event %s: bad NotBefore %r; assuming 30 s",
                                   event.get("EventId"), not_before)
            event_id = str(event.get("EventId") or "")
            return Notice(self.name, kind, deadline=deadline, raw=event,
                          event_id=f"azure-{kind}-{event_id}" if event_id else "")
        return None

    def acknowledge(self, notice: Notice) -> None:
        """Approve the event (``StartRequests``): our state is safe, Azure may proceed now."""
        event_id = notice.raw.get("EventId") if isinstance(notice.raw, dict) else None
        if not self.ack or notice.provider != self.name or not event_id or event_id in self.acknowledged:
            return
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        self._request("POST", EVENTS, body)
        self.acknowledged.append(event_id)
        logger.info("acknowledged Azure scheduled event %s", event_id)

    def wakeup(self) -> None:
        self.client.interrupt()

    def close(self) -> None:
        self.client.close()
