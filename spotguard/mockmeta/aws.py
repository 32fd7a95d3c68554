"""EC2 instance metadata (IMDSv2) as AWS serves it, for the paths spotguard watches.

Faithful where clients notice: the token flow (400 for a missing or out-of-range TTL, 401 for a
missing, invalid or expired token when tokens are required, 403 for a forwarded request), XHTML
error bodies, ``text/plain`` values, the spot action's ``time`` formatted ``2017-09-18T08:22:00Z``
and two minutes after the trigger (the real warning time), and maintenance dates formatted
``21 Jan 2019 09:00:43 GMT``.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
from typing import Any

from .base import CloudMock, Reply, Request

MAX_TTL = 21600
XHTML = """<?xml version="1.0" encoding="iso-8859-1"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"
\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">
<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">
 <head>
  <title>{code} - {reason}</title>
 </head>
 <body>
  <h1>{code} - {reason}</h1>
 </body>
</html>
"""
META = "/latest/meta-data/"


def error(code: int, reason: str) -> Reply:
    return Reply.text(code, XHTML.format(code=code, reason=reason), "text/html")


def _utc(seconds_ahead: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(seconds=seconds_ahead)


class AwsMock(CloudMock):
    """``require_tokens=False`` imitates ``http_tokens = "optional"`` (IMDSv1 still answers)."""

    cloud = "aws"
    kinds = ("spot", "rebalance", "maintenance", "asg")

    def __init__(self, *, require_tokens: bool = True, warning: float = 120.0,
                 instance_id: str = "i-0123456789abcdef0") -> None:
        super().__init__()
        self.require_tokens = require_tokens
        self.warning = warning
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.values: dict[str, str] = {}
        self.static = {"instance-id": instance_id, "instance-type": "g5.xlarge", "ami-id": "ami-0abcdef1234567890",
                       "placement/availability-zone": "us-east-1a", "placement/region": "us-east-1",
                       "instance-life-cycle": "spot"}
        self.reset()

    def reset(self) -> None:
        self.values = {"events/maintenance/scheduled": "[]"}

    def apply(self, kind: str, **options: Any) -> dict[str, Any]:
        if kind == "spot":
            action = options.get("action") or "terminate"
            if action not in ("terminate", "stop", "hibernate"):
                raise ValueError(f"spot action must be terminate, stop or hibernate, got {action!r}")
            when = _utc(float(options.get("warning", self.warning))).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.values["spot/instance-action"] = json.dumps({"action": action, "time": when})
            self.values["spot/termination-time"] = when
            return {"action": action, "time": when}
        if kind == "rebalance":
            when = _utc(0).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.values["events/recommendations/rebalance"] = json.dumps({"noticeTime": when})
            return {"noticeTime": when}
        if kind == "maintenance":
            start = _utc(float(options.get("warning", 300)))
            event = {"NotBefore": start.strftime("%d %b %Y %H:%M:%S GMT"),
                     "NotAfter": (start + dt.timedelta(hours=2)).strftime("%d %b %Y %H:%M:%S GMT"),
                     "Code": options.get("action") or "instance-stop", "Description": "The instance is scheduled for stop",
                     "EventId": "instance-event-" + secrets.token_hex(8), "State": "active"}
            self.values["events/maintenance/scheduled"] = json.dumps([event])
            return event
        self.values["autoscaling/target-lifecycle-state"] = "Terminated"  # asg
        return {"target-lifecycle-state": "Terminated"}

    def describe(self) -> dict[str, Any]:
        return {"notices": {k: v for k, v in self.values.items() if v != "[]"}}

    # -- requests ------------------------------------------------------------------------------
    def handle(self, req: Request) -> Reply:
        if "x-forwarded-for" in req.headers:
            return error(403, "Forbidden")
        if req.path == "/latest/api/token":
            return self._token(req) if req.method == "PUT" else error(405, "Method Not Allowed")
        if req.method != "GET":
            return error(405, "Method Not Allowed")
        token = req.headers.get("x-aws-ec2-metadata-token")
        with self.cond:
            expiry = self.tokens.get(token or "")
            if token is not None and (expiry is None or expiry < time.monotonic()):
                return error(401, "Unauthorized")
            if token is None and self.require_tokens:
                return error(401, "Unauthorized")
            if not req.path.startswith(META):
                return error(404, "Not Found")
            key = req.path[len(META):]
            value = self.values.get(key) or self.static.get(key)
            if value is None and key in ("", "/"):
                value = "\n".join(sorted({k.split("/")[0] for k in (*self.static, *self.values)}))
        if value is None:
            return error(404, "Not Found")
        return Reply.text(200, value)

    def _token(self, req: Request) -> Reply:
        raw = req.headers.get("x-aws-ec2-metadata-token-ttl-seconds")
        try:
            ttl = int(raw or "")
        except ValueError:
            return error(400, "Bad Request")
        if not 1 <= ttl <= MAX_TTL:
            return error(400, "Bad Request")
        token = secrets.token_urlsafe(42)
        with self.cond:
            now = time.monotonic()
            self.tokens = {t: e for t, e in self.tokens.items() if e > now}
            self.tokens[token] = now + ttl
        return Reply.text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})

    def expire_tokens(self) -> None:
        """Make every issued token invalid now (as if its TTL had run out)."""
        with self.cond:
            self.tokens.clear()
