"""Azure notices through Scheduled Events (``/metadata/scheduledevents``) of the instance metadata service.

An event whose ``Resources`` name this VM is a stop notice when it loses the VM's memory or the VM
itself: ``Preempt`` (Spot eviction, 30 s ahead), ``Terminate`` (5 to 15 min), ``Reboot`` (15 min)
and ``Redeploy`` (moved to another host, 10 min); ``Freeze`` (a pause of a few seconds, memory
kept) is only logged. The set is configurable. The deadline is ``NotBefore`` while it lies ahead;
for an event already ``Started`` (``NotBefore`` blank) or past its ``NotBefore`` it is 30 s from
now (it may happen at any moment, yet "no time left" would stop the emergency save before it
starts), and for an unreadable ``NotBefore`` the event type's documented minimum notice. The
document's ``DocumentIncarnation`` changes whenever the event list does, so an unchanged document
is not parsed again: its incarnation is recorded only once it was read through, and an entry that
cannot be read (``Resources: 5``) is skipped with a warning, never hiding the events after it. Once the emergency checkpoint is committed, Guard calls ``acknowledge()``,
which approves the event (``StartRequests``) so Azure need not wait for ``NotBefore``: the
replacement comes sooner.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import logging
import re
import threading
from collections.abc import Iterable
from typing import Any

from spotguard.errors import ConfigError

from .. import _env
from ._http import MetadataProvider, check_status
from .base import Notice, deadline_ahead, utcnow

logger = logging.getLogger(__name__)

ENV_ENDPOINT = _env.AZURE_METADATA_ENDPOINT
DEFAULT_ENDPOINT = "http://169.254.169.254"
API_VERSION = "2020-07-01"
EVENTS = f"/metadata/scheduledevents?api-version={API_VERSION}"
VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}
#: Every documented ``EventType`` and the notice kind it becomes when it is a stop.
KINDS = {"Preempt": "preempt", "Terminate": "terminate", "Reboot": "reboot", "Redeploy": "redeploy", "Freeze": "freeze"}
#: Event types that stop training by default: all but Freeze, which keeps memory and disks.
DEFAULT_STOP_EVENTS = ("Preempt", "Terminate", "Reboot", "Redeploy")
#: The minimum time between an event's appearance and its NotBefore, per type (Azure's documentation;
#: Terminate is user-configurable from 5 to 15 minutes: the least is assumed).
MIN_NOTICE = {
    "Preempt": dt.timedelta(seconds=30),
    "Terminate": dt.timedelta(minutes=5),
    "Reboot": dt.timedelta(minutes=15),
    "Redeploy": dt.timedelta(minutes=10),
    "Freeze": dt.timedelta(minutes=15),
}
#: Assumed time left once an event has started or its NotBefore has passed: the shortest notice.
STARTED_WARNING = MIN_NOTICE["Preempt"]
#: What a VM (or scale-set instance) name looks like; anything else is a garbled answer.
_VM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,79}")


def endpoint() -> str:
    return _env.text(ENV_ENDPOINT) or DEFAULT_ENDPOINT


def parse_stop_events(value: str | Iterable[str]) -> frozenset[str]:
    """``"Preempt,Terminate"`` (or a list) -> the event types, checked against the documented ones."""
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    by_lower = {k.lower(): k for k in KINDS}
    unknown = [n for n in names if n.lower() not in by_lower]
    if unknown:
        raise ConfigError(f"unknown Azure event type(s) {unknown}; known: {', '.join(KINDS)}")
    if not names:  # no event would ever stop training
        raise ConfigError(f"no Azure event type named in {value!r}; known: {', '.join(KINDS)}")
    return frozenset(by_lower[n.lower()] for n in names)


def parse_rfc1123(value: str) -> dt.datetime:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> aware UTC datetime (ValueError when unusable)."""
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"not an RFC 1123 date: {value!r}") from e
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc)


class AzureProvider(MetadataProvider):
    """Watches Azure Scheduled Events. ``stop_events`` names the event types that stop training (default
    ``$SPOTGUARD_AZURE_STOP_EVENTS``, else all but ``Freeze``); ``ack=False`` (default ``$SPOTGUARD_AZURE_ACK``,
    else on) opts out of approving events after a checkpoint."""

    name = "azure"

    def __init__(
        self,
        endpoint_url: str | None = None,
        *,
        stop_events: Iterable[str] | None = None,
        ack: bool | None = None,
        vm_name: str | None = None,
        timeout: float = 1.0,
    ) -> None:
        super().__init__(endpoint_url or endpoint(), timeout, logger)
        # Not given: the job's environment decides (the one channel that reaches a unit's job).
        self.ack = _env.flag(_env.AZURE_ACK, default=True) if ack is None else ack
        if stop_events is None:
            stop_events = _env.choices(_env.AZURE_STOP_EVENTS, frozenset(DEFAULT_STOP_EVENTS), parse_stop_events)
        self.stop_events = parse_stop_events(stop_events)
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
            name = self._request("GET", VM_NAME).strip()
            if not _VM_NAME.fullmatch(name):  # never keep a garbled answer: no event would name it
                raise ValueError(f"{VM_NAME.partition('?')[0]}: not a VM name: {name[:80]!r}")
            self.vm_name = name
        text = self._request("GET", EVENTS)
        try:
            doc = json.loads(text)
            incarnation = int(doc["DocumentIncarnation"])
            events = doc.get("Events") or []
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
        except (ValueError, TypeError, KeyError) as e:
            self._warn("scheduled events: malformed document (%s: %s) %r; ignored", type(e).__name__, e, text[:200])
            return self._current
        if incarnation != self.incarnation:
            current = self._find(events)  # first: a document that fails here is read again next time
            self.incarnation, self._current = incarnation, current
        return self._current

    def _find(self, events: list[Any]) -> Notice | None:
        for event in events:
            try:
                notice = self._notice(event)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                self._warn(
                    "scheduled events: malformed entry %s (%s: %s) %r; skipped",
                    event.get("EventId") if isinstance(event, dict) else None,
                    type(e).__name__,
                    e,
                    str(event)[:200],
                )
                continue
            if notice is not None:
                return notice
        return None

    def _notice(self, event: Any) -> Notice | None:
        """The stop notice ``event`` is for this VM, or None; raises for an entry that cannot be read."""
        if not isinstance(event, dict):
            raise TypeError(f"an event is a JSON object, not {type(event).__name__}")
        etype = str(event.get("EventType"))
        resources = event.get("Resources") or []
        if not isinstance(resources, list):
            raise TypeError(f"Resources is a list of VM names, not {type(resources).__name__}")
        if etype not in self.stop_events:
            if event.get("EventType"):
                logger.info("scheduled %s event %s (not a stop)", event.get("EventType"), event.get("EventId"))
            return None
        if (self.vm_name or "").lower() not in [str(r).lower() for r in resources]:
            return None
        kind = KINDS[etype]
        event_id = str(event.get("EventId") or "")
        return Notice(
            self.name,
            kind,
            deadline=self._deadline(event, etype),
            raw=event,
            event_id=f"azure-{kind}-{event_id}" if event_id else "",
        )

    def _deadline(self, event: dict[str, Any], etype: str) -> dt.datetime:
        not_before = str(event.get("NotBefore") or "")
        if event.get("EventStatus") == "Started" or not not_before:
            return utcnow() + STARTED_WARNING  # underway: as soon as possible, but never "no time left"
        try:
            stated = parse_rfc1123(not_before)
        except ValueError:
            warning = MIN_NOTICE[etype]
            self._warn(
                "scheduled event %s: bad NotBefore %r; assuming %.0f s",
                event.get("EventId"),
                not_before,
                warning.total_seconds(),
            )
            return utcnow() + warning
        return deadline_ahead(stated, STARTED_WARNING)

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
