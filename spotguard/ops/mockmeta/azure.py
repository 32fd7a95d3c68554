"""Azure's instance metadata service: Scheduled Events and the VM name.

Faithful where clients notice: 400 with a JSON error without the ``Metadata: true`` header, without
``api-version``, or for a forwarded request; ``DocumentIncarnation`` that grows with every change;
``Preempt`` events with ``NotBefore`` 30 s ahead in RFC 1123 form; ``StartRequests`` approvals that
turn an event ``Started`` (and are recorded, so a test can see the acknowledgement).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from email.utils import format_datetime
from typing import Any

from spotguard.ops.mockmeta.base import CloudMock, Reply, Request

#: Seconds between an event's appearance and its NotBefore (Azure's documented minimums).
LEAD = {"Preempt": 30, "Terminate": 300, "Reboot": 900, "Redeploy": 600, "Freeze": 900}
KIND_TO_TYPE = {
    "preempt": "Preempt",
    "terminate": "Terminate",
    "reboot": "Reboot",
    "redeploy": "Redeploy",
    "freeze": "Freeze",
}


class AzureMock(CloudMock):
    cloud = "azure"
    kinds = tuple(KIND_TO_TYPE)

    def __init__(self, *, vm_name: str = "spot-trainer-1") -> None:
        super().__init__()
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.acks: list[str] = []

    def reset(self) -> None:
        if self.events:
            self.events = []
            self.incarnation += 1

    def apply(self, kind: str, **options: Any) -> dict[str, Any]:
        etype = KIND_TO_TYPE[kind]
        lead = float(options.get("warning", LEAD[etype]))
        not_before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(seconds=lead)
        event = {
            "EventId": str(uuid.uuid4()).upper(),
            "EventStatus": "Scheduled",
            "EventType": etype,
            "ResourceType": "VirtualMachine",
            "Resources": list(options.get("resources") or [self.vm_name]),
            "NotBefore": format_datetime(not_before, usegmt=True),
            "Description": f"{etype} scheduled by the mock",
            "EventSource": "Platform",
            "DurationInSeconds": -1 if etype in ("Preempt", "Terminate") else 600,
        }
        self.events.append(event)
        self.incarnation += 1
        return event

    def describe(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "events": list(self.events), "acks": list(self.acks)}

    def handle(self, req: Request) -> Reply:
        if "x-forwarded-for" in req.headers:
            return Reply.json(400, {"error": "Bad request. Request contains X-Forwarded-For header"})
        if req.headers.get("metadata", "").lower() != "true":
            return Reply.json(400, {"error": "Bad request. Required metadata header not specified"})
        if "api-version" not in req.query:
            return Reply.json(
                400,
                {
                    "error": "Bad request. api-version was not specified in the request. "
                    "For more information refer to aka.ms/azureimds",
                    "newest-versions": ["2023-07-01", "2021-02-01", "2020-07-01"],
                },
            )
        if req.path == "/metadata/scheduledevents":
            return self._events(req)
        if req.method != "GET":
            return Reply.json(405, {"error": "Method not allowed"})
        compute = {
            "name": self.vm_name,
            "location": "eastus",
            "priority": "Spot",
            "vmSize": "Standard_NC4as_T4_v3",
            "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
            "evictionPolicy": "Deallocate",
        }
        if req.path == "/metadata/instance":
            return Reply.json(200, {"compute": compute, "network": {"interface": []}})
        if req.path.startswith("/metadata/instance/compute/"):
            value = compute.get(req.path.rsplit("/", 1)[1])
            if value is not None:
                if req.query.get("format") == "text":
                    return Reply.text(200, value)
                return Reply.json(200, value)
        return Reply.json(404, {"error": "Not found"})

    def _events(self, req: Request) -> Reply:
        with self.cond:
            if req.method == "GET":
                return Reply.json(200, {"DocumentIncarnation": self.incarnation, "Events": self.events})
            if req.method != "POST":
                return Reply.json(405, {"error": "Method not allowed"})
            try:
                ids = [str(r["EventId"]) for r in json.loads(req.body)["StartRequests"]]
            except (ValueError, KeyError, TypeError):
                return Reply.json(400, {"error": "Bad request. Invalid StartRequests body"})
            for event in self.events:
                if event["EventId"] in ids and event["EventStatus"] != "Started":
                    event["EventStatus"], event["NotBefore"] = "Started", ""
                    self.acks.append(event["EventId"])
                    self.incarnation += 1
            self.cond.notify_all()
        return Reply(200)
