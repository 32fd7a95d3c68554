"""How a rehearsal delivers a notice to the job: a mock metadata service, a SIGTERM, or a notice file.

Each ``Sender`` gives the job's environment (``env``), delivers one notice (``send``), withdraws it
before the next machine starts (``clear``) and releases what it holds (``close``); ``approvals()``
counts the notices the job approved (Azure's ``StartRequests``: the machine may go at once). The mock
metadata server runs in this process, on 127.0.0.1, over real HTTP: the job polls it as it would the
cloud's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from spotguard import _env
from spotguard.notices.file import ENV_VAR as NOTICE_FILE_ENV
from spotguard.ops import mockmeta
from spotguard.ops.supervisor.procs import Job

GCP_DEADLINE_ENV = _env.GCP_DEADLINE


class Sender:
    """Delivers notices of one source; ``lead_s`` is the time from a notice to the machine's end."""

    kind = "?"

    def __init__(self, lead_s: float) -> None:
        self.lead_s = lead_s
        self.env: dict[str, str] = {}

    def send(self, job: Job) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        """Withdraw the notice: the next machine starts without one."""

    def approvals(self) -> int:
        """How many notices the job approved so far (only Azure's events are approved)."""
        return 0

    def close(self) -> None:
        self.clear()


class MockSender(Sender):
    """The cloud's spot notice on a mock metadata server: AWS's action ``time`` and Azure's ``Preempt``
    event's ``NotBefore`` are ``lead_s`` ahead; GCP's notice carries no time (the lead goes in the env)."""

    def __init__(self, cloud: str, lead_s: float) -> None:
        super().__init__(lead_s)
        self.kind = {"aws": "spot", "gcp": "preempt", "azure": "preempt"}[cloud]
        mock = mockmeta.make_mock(cloud, **({"warning": lead_s} if cloud == "aws" else {}))
        self.trigger = {"warning": lead_s} if cloud == "azure" else {}
        self.server = mockmeta.MockMetadataServer(mock).start()
        self.env = mockmeta.endpoint_env(cloud, self.server.url)
        if cloud == "gcp":  # GCP's notice carries no time: tell the job's provider the lead
            self.env[GCP_DEADLINE_ENV] = f"{lead_s:g}"

    def send(self, job: Job) -> None:
        self.server.mock.trigger(self.kind, **self.trigger)

    def approvals(self) -> int:
        return len(getattr(self.server.mock, "acks", ()))

    def clear(self) -> None:
        self.server.mock.clear()

    def close(self) -> None:
        self.server.stop()


class SignalSender(Sender):
    """SIGTERM to the job's topmost processes (a launcher passes it on), as Kubernetes or Slurm do."""

    kind = "signal"

    def send(self, job: Job) -> None:
        job.signal_top(signal.SIGTERM)


class FileSender(Sender):
    """A notice file (``$SPOTGUARD_NOTICE_FILE``) with the deadline in it, written atomically.

    The deadline is absolute (the moment the fleet kills the job): ``deadline_in`` would be counted
    from whenever the job first reads the file, up to a polling interval later.
    """

    kind = "file"

    def __init__(self, lead_s: float, path: Path) -> None:
        super().__init__(lead_s)
        self.path = path
        self.env = {NOTICE_FILE_ENV: str(path)}

    def send(self, job: Job) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"kind": "terminate", "deadline": time.time() + self.lead_s}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def make_sender(source: str, lead_s: float, work_dir: Path) -> Sender:
    if source in ("aws", "gcp", "azure"):
        return MockSender(source, lead_s)
    if source == "signal":
        return SignalSender(lead_s)
    return FileSender(lead_s, work_dir / "notice.json")
