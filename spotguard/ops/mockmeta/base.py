"""What every cloud imitation shares: the request/reply shapes, the state lock, scheduled triggers.

A ``CloudMock`` holds one cloud's metadata state behind a ``threading.Condition``: request handlers
read it, ``trigger()``/``clear()`` (the control API) change it and wake hanging GETs. Triggers with
a delay run on a timer, so ``--notice-after`` and ``simulate-preemption --in`` behave like a notice
that appears later on its own.
"""

from __future__ import annotations

import abc
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spotguard.errors import ConfigError


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names
    body: bytes = b""


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    abort: str | None = None  # "reset" or "truncated": how a storm breaks the answer (server.STORM)
    drip: float = 0.0  # seconds between the body's bytes, sent one at a time (a stalling proxy)
    pad: int = 0  # filler bytes sent after the body, streamed (a huge answer)

    @classmethod
    def text(cls, status: int, text: str, content_type: str = "text/plain", **headers: str) -> Reply:
        return cls(status, text.encode(), {"Content-Type": content_type, **headers})

    @classmethod
    def json(cls, status: int, value: Any, **headers: str) -> Reply:
        return cls(status, json.dumps(value).encode(), {"Content-Type": "application/json", **headers})


class CloudMock(abc.ABC):
    """One cloud's metadata service. Subclasses implement ``handle``, ``apply`` and ``reset``."""

    cloud: str = "?"
    kinds: tuple[str, ...] = ()  # the first one is what ``simulate-preemption`` triggers by default
    #: The real service's ``Server`` header (None: none is sent).
    server_header: ClassVar[str | None] = None
    #: Other headers the real service puts on every answer, errors included (GCP's ``Metadata-Flavor``).
    identity_headers: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.closed = False
        self.requests = 0
        self.triggered: list[dict[str, Any]] = []
        self._timers: list[threading.Timer] = []

    @abc.abstractmethod
    def handle(self, req: Request) -> Reply:
        """Answer one request on the cloud's own paths (never the control API)."""

    @abc.abstractmethod
    def apply(self, kind: str, **options: Any) -> dict[str, Any]:
        """Make a notice of ``kind`` visible now (under ``self.cond``); return what was set."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Withdraw every notice (under ``self.cond``)."""

    def check(self, kind: str, **options: Any) -> None:
        """Raise ``ConfigError`` for options ``apply()`` cannot use: called when a notice is asked
        for, so a delayed one fails at once rather than later in a timer thread."""
        return None

    def describe(self) -> dict[str, Any]:
        return {}

    # -- control -------------------------------------------------------------------------------
    def trigger(self, kind: str | None = None, delay: float = 0.0, **options: Any) -> dict[str, Any]:
        kind = kind or self.kinds[0]
        if kind not in self.kinds:
            raise ConfigError(f"{self.cloud} mock: unknown kind {kind!r}; known: {', '.join(self.kinds)}")
        self.check(kind, **options)
        if delay > 0:
            timer = threading.Timer(delay, self._fire, (kind, options))
            timer.daemon = True
            with self.cond:
                self._timers.append(timer)
            timer.start()
            return {"kind": kind, "in": delay}
        return self._fire(kind, options)

    def _fire(self, kind: str, options: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            if self.closed:
                return {}
            shown = self.apply(kind, **options)
            self.triggered.append({"kind": kind, "at": time.time(), **shown})
            self.cond.notify_all()
        return {"kind": kind, **shown}

    def clear(self) -> None:
        with self.cond:
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()
            self.reset()
            self.cond.notify_all()

    def state(self) -> dict[str, Any]:
        with self.cond:
            return {
                "cloud": self.cloud,
                "kinds": list(self.kinds),
                "requests": self.requests,
                "triggered": list(self.triggered),
                **self.describe(),
            }

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for timer in self._timers:
                timer.cancel()
            self.cond.notify_all()
