"""A time bound for a cloud backend's operations, for commands a person waits on (``spotguard ls --timeout``).

The backends' defaults suit training: a request may wait 60 s for a read and be sent again, and an
operation retries for up to five minutes, so against a service that accepts connections and never
answers an ``ls`` took eight minutes. ``with_timeout`` rewrites a backend's options (``S3Options``,
``GCSOptions``, ``AzureOptions``: whatever of these fields it has) so that each HTTP request waits at
most ``seconds`` to connect and ``seconds`` for each read, is sent once (the operation's own
retries, which back off, take over), and no retry starts after ``seconds``: one operation against a
silent service gives up after about ``seconds``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from ..errors import ConfigError

#: What a storage command waits for one operation by default (seconds).
DEFAULT_TIMEOUT = 60.0


def check(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise ConfigError(f"timeout must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def with_timeout(options: Any, seconds: float) -> Any:
    """A copy of a backend's ``options`` bounded by ``seconds`` per request and per operation."""
    seconds = check(seconds)
    changes: dict[str, Any] = {}
    for name in ("connect_timeout", "urgent_timeout"):  # never longer than the bound, never raised
        if hasattr(options, name):
            changes[name] = min(getattr(options, name), seconds)
    for name in ("read_timeout", "timeout"):
        if hasattr(options, name):
            changes[name] = seconds
    if hasattr(options, "request_attempts"):
        changes["request_attempts"] = 1
    if hasattr(options, "retry"):
        changes["retry"] = dataclasses.replace(options.retry, max_elapsed=min(options.retry.max_elapsed, seconds))
    return dataclasses.replace(options, **changes)


def options_for(cls: type, seconds: float) -> Any | None:
    """The default options of backend class ``cls`` (its ``options`` annotation, a dataclass) bounded
    by ``seconds``; None for a backend without such options (local paths)."""
    try:
        hint = typing.get_type_hints(cls).get("options")
    except (NameError, TypeError):  # an annotation that does not resolve: no options to bound
        return None
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        return None
    return with_timeout(hint(), seconds)
