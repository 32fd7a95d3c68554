"""EC2 instance metadata (IMDSv2) as AWS serves it, for the paths spotguard watches.

Faithful where clients notice: the token flow (400 for a missing or out-of-range TTL, 401 for a
missing, invalid or expired token when tokens are required, 403 for a forwarded request), XHTML
error bodies, ``text/plain`` values, the spot action's ``time`` formatted ``2017-09-18T08:22:00Z``
and two minutes after the trigger (the real warning time), and maintenance dates formatted
``21 Jan 2019 09:00:43 GMT``. Enough of the rest for the SDKs' own metadata clients (a rehearsal on
a laptop or on a real VM runs the same code): fake instance-role credentials
(``iam/security-credentials/ROLE``, which botocore's credential chain reads), ``iam/info``, the
identity document (``dynamic/instance-identity/document``, where ec2-metadata finds the region),
directory listings with a trailing ``/`` on subdirectories, leaves that answer with or without a
trailing slash (botocore asks for ``placement/availability-zone/``), the remaining token TTL on
every GET made with a token, and ``Server: EC2ws``.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
from typing import Any

from spotguard.errors import ConfigError
from spotguard.ops.mockmeta.base import CloudMock, Reply, Request

MAX_TTL = 21600
ROLE = "spotguard-mock-role"
SPOT_ACTIONS = ("terminate", "stop", "hibernate")
#: Every documented scheduled-event code, with the description EC2 gives it.
EVENT_CODES = {
    "instance-stop": "The instance is scheduled for stop",
    "instance-retirement": "The instance is running on degraded hardware",
    "instance-reboot": "The instance is scheduled for reboot",
    "system-reboot": "scheduled reboot",
    "system-maintenance": "scheduled maintenance",
}
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
LATEST = "/latest/"


def error(code: int, reason: str) -> Reply:
    return Reply.text(code, XHTML.format(code=code, reason=reason), "text/html")


def _utc(seconds_ahead: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(seconds=seconds_ahead)


class AwsMock(CloudMock):
    """``require_tokens=False`` imitates ``http_tokens = "optional"`` (IMDSv1 still answers)."""

    cloud = "aws"
    kinds = ("spot", "rebalance", "maintenance", "asg")
    server_header = "EC2ws"

    def __init__(
        self,
        *,
        require_tokens: bool = True,
        warning: float = 120.0,
        instance_id: str = "i-0123456789abcdef0",
        region: str = "us-east-1",
    ) -> None:
        super().__init__()
        self.require_tokens = require_tokens
        self.warning = warning
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.values: dict[str, str] = {}
        self.credentials: dict[str, str] = {}
        zone = region + "a"
        self.static = {
            "instance-id": instance_id,
            "instance-type": "g5.xlarge",
            "ami-id": "ami-0abcdef1234567890",
            "placement/availability-zone": zone,
            "placement/region": region,
            "instance-life-cycle": "spot",
            "iam/info": json.dumps(
                {
                    "Code": "Success",
                    "LastUpdated": _utc(0).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "InstanceProfileArn": f"arn:aws:iam::123456789012:instance-profile/{ROLE}",
                    "InstanceProfileId": "AIPAMOCKPROFILEID0000",
                },
                indent=2,
            ),
        }
        self.identity = {
            "accountId": "123456789012",
            "architecture": "x86_64",
            "availabilityZone": zone,
            "billingProducts": None,
            "devpayProductCodes": None,
            "marketplaceProductCodes": None,
            "imageId": self.static["ami-id"],
            "instanceId": instance_id,
            "instanceType": "g5.xlarge",
            "kernelId": None,
            "pendingTime": _utc(0).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "privateIp": "10.0.0.12",
            "ramdiskId": None,
            "region": region,
            "version": "2017-09-30",
        }
        self.reset()

    def reset(self) -> None:
        self.values = {"events/maintenance/scheduled": "[]"}

    def check(self, kind: str, **options: Any) -> None:
        action = options.get("action")
        if kind == "spot" and action and action not in SPOT_ACTIONS:
            raise ConfigError(f"spot action must be terminate, stop or hibernate, got {action!r}")
        if kind == "maintenance" and action and action not in EVENT_CODES:
            raise ConfigError(f"scheduled event code must be one of {', '.join(EVENT_CODES)}, got {action!r}")

    def apply(self, kind: str, **options: Any) -> dict[str, Any]:
        if kind == "spot":
            action = options.get("action") or "terminate"
            when = _utc(float(options.get("warning", self.warning))).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.values["spot/instance-action"] = json.dumps({"action": action, "time": when})
            self.values["spot/termination-time"] = when
            return {"action": action, "time": when}
        if kind == "rebalance":
            when = _utc(0).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.values["events/recommendations/rebalance"] = json.dumps({"noticeTime": when})
            return {"noticeTime": when}
        if kind == "maintenance":
            code = options.get("action") or "instance-stop"
            start = _utc(float(options.get("warning", 300)))
            event = {
                "NotBefore": start.strftime("%d %b %Y %H:%M:%S GMT"),
                "Code": code,
                "Description": EVENT_CODES[code],
                "EventId": "instance-event-" + secrets.token_hex(8),
                "State": "active",
            }
            # The codes with a window end two hours later unless ``window`` (seconds) says otherwise; a
            # negative ``warning`` gives a window already open (the public AWS mock's default event).
            window = options.get("window")
            if window is not None or code in ("instance-reboot", "system-reboot", "system-maintenance"):
                end = start + dt.timedelta(seconds=float(7200 if window is None else window))
                event["NotAfter"] = end.strftime("%d %b %Y %H:%M:%S GMT")
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
            value = self._lookup(req.path[len(LATEST) :]) if req.path.startswith(LATEST) else None
        if value is None:
            return error(404, "Not Found")
        headers = (
            {}
            if expiry is None
            else {"X-Aws-Ec2-Metadata-Token-Ttl-Seconds": str(max(0, int(expiry - time.monotonic())))}
        )
        return Reply.text(200, value, **headers)

    def _tree(self) -> dict[str, str]:
        """Every leaf under ``/latest/``, by its path (under ``self.cond``)."""
        tree = {"meta-data/" + k: v for k, v in {**self.static, **self.values}.items()}
        tree[f"meta-data/iam/security-credentials/{ROLE}"] = json.dumps(self._credentials(), indent=2)
        tree["dynamic/instance-identity/document"] = json.dumps(self.identity, indent=2)
        return tree

    def _lookup(self, key: str) -> str | None:
        """A leaf (with or without a trailing slash, as IMDS answers both) or a directory listing."""
        tree = self._tree()
        leaf = tree.get(key.rstrip("/")) if key else None
        if leaf is not None:
            return leaf
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        names = sorted(
            {
                rest.split("/")[0] + ("/" if "/" in rest else "")
                for k in tree
                if k.startswith(prefix)
                for rest in (k[len(prefix) :],)
            }
        )
        return "\n".join(names) if names else None

    def _credentials(self) -> dict[str, str]:
        """Fake temporary credentials of the instance role, renewed like the real ones before expiry."""
        expires = self.credentials.get("Expiration", "")
        if not expires or expires < _utc(300).strftime("%Y-%m-%dT%H:%M:%SZ"):
            self.credentials = {
                "Code": "Success",
                "LastUpdated": _utc(0).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "Type": "AWS-HMAC",
                "AccessKeyId": "ASIA" + secrets.token_hex(8).upper(),
                "SecretAccessKey": secrets.token_urlsafe(30),
                "Token": "IQoJb3JpZ2luX2VjEMOCK" + secrets.token_urlsafe(96),
                "Expiration": _utc(6 * 3600).strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        return self.credentials

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
