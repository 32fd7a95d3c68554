"""Events: what a Guard or ``spotguard run`` did, pushed to listeners as plain JSON-ready dicts.

Why listeners rather than polling: a checkpoint commits in a background thread, a notice arrives
in a watcher thread; a listener hears it when it happens, and nothing is added to ``guard.step()``
when nothing happens. ``spotguard.metrics`` is one listener (Prometheus, JSON lines); a user may
add their own (e.g. to log to an experiment tracker).

A listener is called in the thread where the event happened (the training loop, the background
writer, a watcher thread): it must be quick and must not block (queue the record and return).
What it raises is logged and dropped, never passed to the caller.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Record = dict[str, Any]
Listener = Callable[[Record], None]


class Events:
    """A list of listeners and ``emit()``; free when nobody listens."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def add(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def emit(self, event: str, **fields: Any) -> None:
        """Build ``{"event", "time" (UTC ISO 8601), "unix", **fields}`` and hand it to every listener."""
        if not self._listeners:
            return
        now = time.time()
        record: Record = {
            "event": event,
            "time": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(),
            "unix": now,
            **fields,
        }
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:
                logger.exception("event listener %r failed on a %s event", listener, event)
