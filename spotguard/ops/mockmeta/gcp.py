"""The GCE metadata server as Google serves it, for the paths spotguard and google-auth use.

Faithful where clients notice: 403 without ``Metadata-Flavor: Google`` (and for a forwarded
request), that header on every response, ``application/text`` values with an ``ETag``, the hanging
GET (``wait_for_change=true`` blocks while ``last_etag`` equals the current ETag, or until the next
change when no ``last_etag`` is given, for at most ``timeout_sec``), ``GET /`` answering 200 so
google-auth's ``ping()`` recognises the server, and ``preempted`` flipping at once on a trigger.
Enough of the rest for google-auth's compute-engine credentials (a rehearsal runs the same code as
on a VM): the default service account (``aliases``, ``email``, ``scopes``, its recursive listing
as JSON with lists) and a fake ``token``; recursive listings with Google's camelCase keys; and
``Server: Metadata Server for VM``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from spotguard.ops.mockmeta.base import CloudMock, Reply, Request

ROOT = "/computeMetadata/v1/"
FLAVOR = {"Metadata-Flavor": "Google"}
NOT_FOUND = """<!DOCTYPE html>
<html lang=en>
  <meta charset=utf-8>
  <title>Error 404 (Not Found)!!1</title>
  <p><b>404.</b> <ins>That's an error.</ins>
  <p>The requested URL <code>{path}</code> was not found on this server.  <ins>That's all we know.</ins>
"""
MAX_WAIT = 3600
SCOPES = ("https://www.googleapis.com/auth/cloud-platform", "https://www.googleapis.com/auth/userinfo.email")
LISTS = ("aliases", "scopes")  # newline-separated values that recursive listings give as JSON arrays


def etag_of(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


class GcpMock(CloudMock):
    cloud = "gcp"
    kinds = ("preempt", "maintenance", "migrate")
    server_header = "Metadata Server for VM"
    identity_headers = FLAVOR

    def __init__(self, *, name: str = "spot-trainer-1", project: str = "mock-project", etag_prefix: str = "") -> None:
        super().__init__()
        #: Put before every ETag: a proxy that rewrites ETags (tests give it spaces and odd characters).
        self.etag_prefix = etag_prefix
        self.values: dict[str, str] = {
            "instance/id": "4520031799277581759",
            "instance/name": name,
            "instance/hostname": f"{name}.us-central1-a.c.{project}.internal",
            "instance/zone": "projects/123456789012/zones/us-central1-a",
            "instance/machine-type": "projects/123456789012/machineTypes/g2-standard-4",
            "instance/scheduling/provisioning-model": "SPOT",
            "instance/scheduling/preemptible": "TRUE",
            "project/project-id": project,
            "project/numeric-project-id": "123456789012",
        }
        email = "123456789012-compute@developer.gserviceaccount.com"
        for account in ("default", email):
            self.values.update(
                {
                    f"instance/service-accounts/{account}/aliases": "default",
                    f"instance/service-accounts/{account}/email": email,
                    f"instance/service-accounts/{account}/scopes": "\n".join(SCOPES),
                }
            )
        self.reset()

    def reset(self) -> None:
        self.values["instance/preempted"] = "FALSE"
        self.values["instance/maintenance-event"] = "NONE"

    def apply(self, kind: str, **options: Any) -> dict[str, Any]:
        if kind == "preempt":
            self.values["instance/preempted"] = "TRUE"
            return {"instance/preempted": "TRUE"}
        event = "TERMINATE_ON_HOST_MAINTENANCE" if kind == "maintenance" else "MIGRATE_ON_HOST_MAINTENANCE"
        self.values["instance/maintenance-event"] = event
        return {"instance/maintenance-event": event}

    def describe(self) -> dict[str, Any]:
        return {"notices": {k: self.values[k] for k in ("instance/preempted", "instance/maintenance-event")}}

    def handle(self, req: Request) -> Reply:
        if "x-forwarded-for" in req.headers:
            return Reply.text(403, "Request denied: X-Forwarded-For header present.", "text/html", **FLAVOR)
        if req.path in ("/", ""):
            return Reply.text(200, "computeMetadata/\n", "application/text", **FLAVOR)
        if req.headers.get("metadata-flavor") != "Google":
            return Reply.text(403, "Missing Metadata-Flavor:Google header.", "text/html", **FLAVOR)
        if not req.path.startswith(ROOT) or req.method != "GET":
            return self._not_found(req)
        key = req.path[len(ROOT) :]
        if key.startswith("instance/service-accounts/") and key.endswith("/token"):
            return self._token(req, key)
        with self.cond:
            if key.endswith("/") or key == "":
                return self._directory(req, key)
            if key not in self.values:
                return self._not_found(req)
            if req.query.get("wait_for_change", "").lower() == "true":
                self._wait(req, key)
            value = self.values[key]
        tag = self._etag(value)
        if req.query.get("alt") == "json":
            return Reply.text(200, json.dumps(value), "application/json", ETag=tag, **FLAVOR)
        return Reply.text(200, value, "application/text", ETag=tag, **FLAVOR)

    def _wait(self, req: Request, key: str) -> None:
        """Block (under ``self.cond``) while the value keeps the ETag the client already has."""
        try:
            limit = min(float(req.query.get("timeout_sec", MAX_WAIT)), MAX_WAIT)
        except ValueError:
            limit = MAX_WAIT
        seen = req.query.get("last_etag") or self._etag(self.values[key])
        end = time.monotonic() + limit
        while self._etag(self.values[key]) == seen and not self.closed:
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cond.wait(left)

    def _etag(self, value: str) -> str:
        return self.etag_prefix + etag_of(value)

    def _token(self, req: Request, key: str) -> Reply:
        account = key[len("instance/service-accounts/") : -len("/token")]
        if f"instance/service-accounts/{account}/email" not in self.values:
            return self._not_found(req)
        token = {"access_token": "ya29.mock-" + secrets.token_urlsafe(48), "expires_in": 3599, "token_type": "Bearer"}
        return Reply.text(200, json.dumps(token), "application/json", **FLAVOR)

    def _directory(self, req: Request, key: str) -> Reply:
        entries = {k[len(key) :] for k in self.values if k.startswith(key)}
        if req.query.get("recursive") == "true":
            tree: dict[str, Any] = {}
            for entry in sorted(entries):
                *parents, leaf = entry.split("/")
                node = tree
                for part in parents:
                    node = node.setdefault(_camel(part), {})
                value = self.values[key + entry]
                node[_camel(leaf)] = value.split("\n") if leaf in LISTS else value
            return Reply.text(200, json.dumps(tree), "application/json", **FLAVOR)
        names = sorted({e.split("/")[0] + ("/" if "/" in e else "") for e in entries})
        if not names:
            return self._not_found(req)
        return Reply.text(200, "\n".join(names) + "\n", "application/text", **FLAVOR)

    def _not_found(self, req: Request) -> Reply:
        return Reply.text(404, NOT_FOUND.format(path=req.path), "text/html; charset=UTF-8", **FLAVOR)


def _camel(name: str) -> str:
    """``machine-type`` -> ``machineType``: recursive listings spell keys the way the API does."""
    first, *rest = name.split("-")
    return first + "".join(part[:1].upper() + part[1:] for part in rest)
