"""Opt-ins from environment variables, for objects the user's code does not construct.

Providers built by name (``providers="auto"``, ``--providers aws``) and a Guard inside a job that a
systemd unit, ``spotguard run`` or torchrun starts can be reached by the environment alone. A value
that cannot be read is a ``ConfigError`` naming the variable, never a silent default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar, overload

from .errors import ConfigError

AWS_ALLOW_IMDSV1 = "SPOTGUARD_AWS_ALLOW_IMDSV1"
AZURE_ACK = "SPOTGUARD_AZURE_ACK"
AZURE_STOP_EVENTS = "SPOTGUARD_AZURE_STOP_EVENTS"
GCP_DEADLINE = "SPOTGUARD_GCP_DEADLINE"
STOP_ON_ADVISORY = "SPOTGUARD_STOP_ON_ADVISORY"
DEADLINE_POLICY = "SPOTGUARD_DEADLINE_POLICY"  # a Guard's deadline_policy: stop or use-window
STORAGE = "SPOTGUARD_STORAGE"  # the durable URL of a Guard built without one
LOCAL_DIR = "SPOTGUARD_LOCAL_DIR"  # its fast first tier (`spotguard run --local-dir`)
METRICS_FILE = "SPOTGUARD_METRICS_FILE"  # JSON lines of a Guard built without one (`spotguard rehearse`)
CHECKSUM = "SPOTGUARD_CHECKSUM"  # the checksum of new checkpoints (spotguard.checkpoint.format.digest)
TAKEOVER = "SPOTGUARD_TAKEOVER"  # 1: take over a live writer lease (`spotguard run --takeover`)
NOTICE_FILE = "SPOTGUARD_NOTICE_FILE"  # a flag file that means "stop" (``{rank}`` for one per rank)
HEARTBEAT = "SPOTGUARD_HEARTBEAT"  # the file of slots `spotguard run` shares with the job (spotguard.heartbeat)
TMPDIR = "SPOTGUARD_TMPDIR"  # where staging files of uploads and downloads go (default: the system's)
AZURE_METADATA_ENDPOINT = "SPOTGUARD_AZURE_METADATA_ENDPOINT"  # Azure's IMDS elsewhere (a mock, a proxy)
# Variables of other tools are read where they are used, as those tools read them: the launchers'
# RANK / LOCAL_RANK / WORLD_SIZE, AWS_EC2_METADATA_SERVICE_ENDPOINT, GCE_METADATA_HOST, Azure's and Ray's.

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@overload
def storage_or_env(given: None) -> str: ...
@overload
def storage_or_env(given: T) -> T: ...
def storage_or_env(given: T | None) -> T | str:
    """The storage a job was given, else ``$SPOTGUARD_STORAGE`` (set by `spotguard run`, terraform)."""
    if given is not None:
        return given
    url = os.environ.get(STORAGE, "").strip()
    if not url:
        raise ConfigError(f"no storage given: pass a URL or set ${STORAGE}")
    return url


def text(name: str) -> str | None:
    """The variable's value, stripped; unset or empty: None."""
    return os.environ.get(name, "").strip() or None


def flag(name: str, default: bool) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case); unset or empty: ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ConfigError(f"${name} must be 1 or 0 (or true/false, yes/no, on/off), got {os.environ[name]!r}")


def seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds; unset or empty: ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        parsed = float(value)
    except ValueError:
        parsed = math.nan
    if not (math.isfinite(parsed) and parsed > 0):
        raise ConfigError(f"${name} must be a positive number of seconds, got {os.environ[name]!r}")
    return parsed


def choices(name: str, default: T, parse: Callable[[str], T]) -> T:
    """A value read by ``parse`` (which raises ValueError on a bad one); unset or empty: ``default``."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"${name}: {e}") from None
