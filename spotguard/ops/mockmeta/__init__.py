"""A local, faithful imitation of the AWS, GCP and Azure metadata services (for rehearsals and tests).

``make_mock("aws")`` gives the cloud's state; ``MockMetadataServer(mock).start()`` serves it over
real HTTP on 127.0.0.1; ``control(url, "trigger", {...})`` drives a running server from elsewhere
(this is what ``spotguard simulate-preemption`` does).
"""

from __future__ import annotations

from typing import Any

from spotguard import _env
from spotguard.errors import ConfigError
from spotguard.ops.mockmeta.aws import AwsMock
from spotguard.ops.mockmeta.azure import AzureMock
from spotguard.ops.mockmeta.base import CloudMock, Reply, Request
from spotguard.ops.mockmeta.gcp import GcpMock
from spotguard.ops.mockmeta.server import DEFAULT_PORT, MockControlError, MockMetadataServer, control

__all__ = [
    "CLOUDS",
    "DEFAULT_PORT",
    "AwsMock",
    "AzureMock",
    "CloudMock",
    "GcpMock",
    "MockControlError",
    "MockMetadataServer",
    "Reply",
    "Request",
    "control",
    "endpoint_env",
    "make_mock",
]

CLOUDS: dict[str, type[CloudMock]] = {"aws": AwsMock, "gcp": GcpMock, "azure": AzureMock}


def make_mock(cloud: str, **options: Any) -> CloudMock:
    try:
        return CLOUDS[cloud](**options)
    except KeyError:
        raise ConfigError(f"unknown cloud {cloud!r}; choose one of {', '.join(CLOUDS)}") from None


def endpoint_env(cloud: str, url: str) -> dict[str, str]:
    """The environment variables that point spotguard (and the cloud's own clients) at ``url``."""
    hostport = url.split("://", 1)[-1].rstrip("/")
    if cloud == "aws":
        return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": url}
    if cloud == "gcp":
        return {"GCE_METADATA_HOST": hostport, "GCE_METADATA_IP": hostport}
    if cloud == "azure":
        return {_env.AZURE_METADATA_ENDPOINT: url}
    raise ConfigError(f"unknown cloud {cloud!r}")
