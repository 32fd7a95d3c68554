"""AWS EC2 notices through the instance metadata service, IMDSv2 only (unless the user opts in).

One ``poll()`` reads, in order of severity: the spot interruption (``spot/instance-action``), active
scheduled events that stop, retire or reboot the instance (``events/maintenance/scheduled``), the
Auto Scaling target lifecycle state (``Terminated`` on scale-in), and the rebalance recommendation
(advisory). A 404 means "nothing". Malformed content is logged and never becomes a stop on its own.

Each notice has an id made of what it is (the spot action, the scheduled event's id), never of
its payload's times: a service that restamps ``time`` or ``noticeTime`` on every request (as the
public AWS metadata mock does) still gives one notice, so one early checkpoint.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import time
from typing import Any

from spotguard.errors import ConfigError

from .. import _env
from ._http import MetadataHTTPError, MetadataProvider, check_status
from .base import Notice, deadline_ahead, utcnow
from .file import parse_time

logger = logging.getLogger(__name__)

ENV_ENDPOINT = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL = 21600  # the maximum IMDS allows (6 hours)
#: AWS gives two minutes between the spot notice and the interruption.
SPOT_WARNING = dt.timedelta(minutes=2)
STOP_ACTIONS = ("terminate", "stop", "hibernate")
#: Scheduled-event codes (EC2 ``InstanceStatusEvent.code``) that stop, retire or reboot the instance:
#: every documented code, since each one loses the instance's memory or its network for a while.
MAINTENANCE_CODES = ("instance-stop", "instance-retirement", "instance-reboot", "system-reboot", "system-maintenance")
#: A scheduled event whose window is already open may start at any moment: its NotAfter is only the
#: window's latest end (days away, 7 in the public AWS metadata mock's default event). AWS documents
#: no shorter warning than the spot two minutes, so that is the time assumed once the window opens.
MAINTENANCE_WARNING = SPOT_WARNING
_TOKEN = re.compile(r"[A-Za-z0-9+/=_.-]{1,512}")  # what an IMDSv2 token looks like (printable, no spaces)
HOP_LIMIT_HINT = (
    "no answer to PUT /latest/api/token, although something listens: in a container, the "
    "instance's metadata hop limit must be 2 (aws ec2 modify-instance-metadata-options "
    "--http-put-response-hop-limit 2); or allow IMDSv1 with $SPOTGUARD_AWS_ALLOW_IMDSV1=1"
)

SPOT = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"
LIFECYCLE = "/latest/meta-data/autoscaling/target-lifecycle-state"


def endpoint() -> str:
    return os.environ.get(ENV_ENDPOINT) or DEFAULT_ENDPOINT


def parse_maintenance_time(value: str) -> dt.datetime:
    """``21 Jan 2019 09:00:43 GMT`` (the scheduled-events format) -> aware UTC datetime."""
    return dt.datetime.strptime(value.strip(), "%d %b %Y %H:%M:%S GMT").replace(tzinfo=dt.timezone.utc)


class AwsProvider(MetadataProvider):
    """Watches the EC2 metadata service.

    ``allow_imdsv1``: fall back to token-less requests when the token endpoint refuses (default
    ``$SPOTGUARD_AWS_ALLOW_IMDSV1``, else off: IMDSv1 is the SSRF-prone variant).
    ``maintenance_horizon``: an active scheduled maintenance event becomes a notice only this many
    seconds before its ``NotBefore``, so an event announced days ahead does not stop training today.
    """

    name = "aws"

    def __init__(
        self,
        endpoint_url: str | None = None,
        *,
        timeout: float = 1.0,
        allow_imdsv1: bool | None = None,
        token_ttl: int = TOKEN_TTL,
        maintenance_horizon: float = 600.0,
    ) -> None:
        if not 1 <= token_ttl <= TOKEN_TTL:
            raise ConfigError(f"token_ttl must be within 1..{TOKEN_TTL}, got {token_ttl}")
        super().__init__(endpoint_url or endpoint(), timeout, logger)
        if allow_imdsv1 is None:  # not given: the job's environment decides (the one channel to a unit's job)
            allow_imdsv1 = _env.flag(_env.AWS_ALLOW_IMDSV1, default=False)
        self.allow_imdsv1 = allow_imdsv1
        self.token_ttl = token_ttl
        self.maintenance_horizon = maintenance_horizon
        self._token: str | None = None
        self._token_expires = 0.0  # monotonic
        self._v1 = False

    # -- IMDSv2 token --------------------------------------------------------------------------
    def _refresh_token(self) -> None:
        try:
            resp = self.client.request(
                "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)}
            )
        except MetadataHTTPError as e:
            if not e.read_timeout:
                raise
            # The PUT's answer was dropped on the way (a container one hop beyond a hop limit of 1).
            # botocore treats this timeout as "no token" and goes on with IMDSv1; so do we, if allowed.
            if not self.allow_imdsv1:
                raise MetadataHTTPError(f"IMDSv2 token request timed out: {HOP_LIMIT_HINT}") from e
            self._warn("IMDSv2 token request timed out (%s); using IMDSv1 as allowed", self.client.base_url)
            self._v1 = True
            return
        token = resp.text.strip()
        if resp.status == 200 and token and not _TOKEN.fullmatch(token):
            # A garbled answer kept as the token would be sent for hours (or be refused as a header).
            raise MetadataHTTPError(f"IMDSv2 token request: not a token ({len(token)} bytes of something else)")
        if resp.status == 200 and token:
            self._token = token
            # Renew well before expiry: a token used at its last second can expire in flight.
            self._token_expires = time.monotonic() + self.token_ttl * 0.8
            self._v1 = False
            return
        if self.allow_imdsv1 and resp.status in (403, 404, 405):
            if not self._v1:
                self._warn("IMDSv2 token refused (HTTP %d); using IMDSv1 as allowed", resp.status)
            self._v1 = True
            return
        raise MetadataHTTPError(f"IMDSv2 token request failed: HTTP {resp.status}", resp.status)

    def _get(self, path: str) -> tuple[int, str]:
        for attempt in (0, 1):
            if not self._v1 and (self._token is None or time.monotonic() >= self._token_expires):
                self._refresh_token()
            headers = {} if self._v1 else {"X-aws-ec2-metadata-token": self._token or ""}
            resp = self.client.request("GET", path, headers)
            if resp.status == 401 and attempt == 0:
                self._token = None  # expired or revoked: one fresh token, then give up
                continue
            check_status(resp.status, (200, 404), f"GET {path}")
            return resp.status, resp.text
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the checks ----------------------------------------------------------------------------
    def poll(self) -> Notice | None:
        # Most severe first, and stop at the first stop notice: a later failing request must not
        # hide a notice already found.
        notice = self._spot()
        if notice is None:
            notice = next(iter(self._maintenance()), None) or self._lifecycle()
        return notice or self._rebalance()

    def _json(self, path: str) -> Any:
        status, text = self._get(path)
        if status == 404:
            return None
        try:
            return json.loads(text)
        except ValueError:
            self._warn("%s: malformed JSON %r; ignored", path, text[:200])
            return None

    def _spot(self) -> Notice | None:
        data = self._json(SPOT)
        if data is None:
            return None
        action = data.get("action") if isinstance(data, dict) else None
        if action not in STOP_ACTIONS:
            self._warn("%s: unexpected content %r; ignored", SPOT, data)
            return None
        now = utcnow()
        try:
            stated: dt.datetime | None = parse_time(data.get("time"))
        except (ValueError, TypeError, OverflowError):
            # The action itself is unambiguous; only its time is unusable: assume the documented 2 min.
            stated = None
            self._warn("%s: bad time %r; assuming the deadline is 2 minutes away", SPOT, data.get("time"))
        else:
            if stated is not None and stated <= now:
                self._warn("%s: time %r has passed; assuming the deadline is 2 minutes away", SPOT, data.get("time"))
        return Notice(
            self.name,
            action,
            deadline=deadline_ahead(stated, SPOT_WARNING, now),
            raw=data,
            event_id=f"aws-spot-{action}",
        )

    def _maintenance(self) -> list[Notice]:
        events = self._json(MAINTENANCE)
        if not events:
            return []
        if not isinstance(events, list):
            self._warn("%s: expected a JSON array, got %r; ignored", MAINTENANCE, events)
            return []
        out: list[Notice] = []
        now = utcnow()
        for event in events:
            if (
                not isinstance(event, dict)
                or event.get("State") != "active"
                or event.get("Code") not in MAINTENANCE_CODES
            ):
                continue
            try:
                not_before = parse_maintenance_time(str(event.get("NotBefore", "")))
            except ValueError:
                self._warn(
                    "%s: event %s has a bad NotBefore %r; ignored",
                    MAINTENANCE,
                    event.get("EventId"),
                    event.get("NotBefore"),
                )
                continue
            if (not_before - now).total_seconds() > self.maintenance_horizon:
                logger.debug(
                    "scheduled %s at %s: not yet within %.0fs", event.get("Code"), not_before, self.maintenance_horizon
                )
                continue
            out.append(
                Notice(
                    self.name,
                    "maintenance",
                    deadline=self._window_deadline(not_before, now),
                    raw=event,
                    event_id=self._event_id(event),
                )
            )
        return out

    @staticmethod
    def _window_deadline(not_before: dt.datetime, now: dt.datetime) -> dt.datetime:
        """NotBefore while ahead; once the window is open, the documented minimum from now (never
        NotAfter: the event may start at any moment of the window)."""
        return deadline_ahead(not_before, MAINTENANCE_WARNING, now)

    @staticmethod
    def _event_id(event: dict[str, Any]) -> str:
        ident = str(event.get("EventId") or "") or f"{event.get('Code')}-{event.get('NotBefore')}"
        return f"aws-maintenance-{ident}"

    def _lifecycle(self) -> Notice | None:
        status, text = self._get(LIFECYCLE)
        if status == 200 and text.strip() == "Terminated":
            return Notice(
                self.name, "terminate", raw={"target-lifecycle-state": "Terminated"}, event_id="aws-asg-terminate"
            )
        return None

    def _rebalance(self) -> Notice | None:
        data = self._json(REBALANCE)
        if data is None:
            return None
        if not isinstance(data, dict) or "noticeTime" not in data:
            self._warn("%s: unexpected content %r; ignored", REBALANCE, data)
            return None
        return Notice(self.name, "rebalance", raw=data, event_id="aws-rebalance")

    def wakeup(self) -> None:
        self.client.interrupt()

    def close(self) -> None:
        self.client.close()
