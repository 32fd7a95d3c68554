"""What a notice is, and the one interface every source of notices implements.

Call order, from the watcher's side: ``open(report)`` once from the thread that starts the watcher
(the main thread, so signal handlers can be installed), then ``poll()`` of each of ``channels()``
repeatedly, each channel from a watcher thread of its own, then each channel's ``wakeup()`` (from
any thread) and finally the provider's ``close()`` from the thread that stops the watcher. A
provider checks once per ``poll()``; the loop, timing, error logging and retries live in the
watcher. Most providers are their own one channel; one that waits on two things at once (GCP's
two hanging GETs) has a channel per wait, so neither wait delays the other.
"""

from __future__ import annotations

import abc
import datetime as dt
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotguard.errors import ConfigError

#: Notice kinds that announce the machine goes away. Anything else is advisory.
STOP_KINDS = frozenset(
    {"terminate", "stop", "hibernate", "preempt", "maintenance", "reboot", "redeploy", "signal", "file"}
)
#: Advisory kinds: the machine is at risk but not yet reclaimed (an early checkpoint is worth it).
ADVISORY_KINDS = frozenset({"rebalance", "migrate"})


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class Notice:
    """One announcement that this machine is going away (or is at risk).

    ``event_id`` is stable: the same notice seen on ten polls has the same id, so the watcher
    reports it once. It is derived from the provider, kind and payload, never from the time seen.
    """

    provider: str
    kind: str
    deadline: dt.datetime | None = None
    received_at: dt.datetime = field(default_factory=utcnow, compare=False)
    event_id: str = ""
    raw: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.deadline is not None and self.deadline.tzinfo is None:
            raise ConfigError("Notice.deadline must be timezone-aware (UTC)")
        if not self.event_id:
            object.__setattr__(self, "event_id", stable_id(self.provider, self.kind, self.raw))

    @property
    def advisory(self) -> bool:
        """True for notices that do not by themselves mean the machine is reclaimed."""
        return self.kind in ADVISORY_KINDS

    def seconds_left(self, now: dt.datetime | None = None) -> float | None:
        """Seconds until the deadline (negative when past), or None when there is no deadline."""
        if self.deadline is None:
            return None
        return (self.deadline - (now or utcnow())).total_seconds()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for ``spotguard watch --json``, logs and status files)."""
        return {
            "provider": self.provider,
            "kind": self.kind,
            "advisory": self.advisory,
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "received_at": self.received_at.isoformat(),
            "event_id": self.event_id,
            "raw": self.raw if _is_jsonable(self.raw) else repr(self.raw),
        }


def deadline_ahead(stated: dt.datetime | None, warning: dt.timedelta, now: dt.datetime | None = None) -> dt.datetime:
    """The cloud's stated deadline while it lies ahead, else ``now + warning`` (the cloud's documented
    minimum warning).

    A stated time already past (a stale spot ``time``, an AWS maintenance window already open, an
    Azure event already started, a skewed clock) cannot be the deadline while this machine still
    runs: "no time left" would make the emergency save refuse to start and lose the work. A stated
    time ahead is kept even when it is closer than the warning: the notice may have been seen late.
    """
    now = now or utcnow()
    return stated if stated is not None and stated > now else now + warning


def stable_id(provider: str, kind: str, raw: Any) -> str:
    """A short hash of the payload: identical payloads give identical ids (cf. NTH's event ids)."""
    try:
        payload = json.dumps(raw, sort_keys=True, default=str)
    except (TypeError, ValueError):
        payload = repr(raw)
    digest = hashlib.sha256(f"{provider}\0{kind}\0{payload}".encode()).hexdigest()
    return f"{provider}-{kind}-{digest[:16]}"


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


Report = Callable[[Notice], None]


class NoticeProvider(abc.ABC):
    """A source of notices: a signal, a flag file, a cloud's metadata service.

    Subclasses set ``name`` and implement ``poll()``. ``poll()`` may block briefly (a hanging GET,
    a queue wait) when ``blocking`` is True; the watcher then does not sleep between polls.
    ``poll()`` may raise: the watcher logs, backs off and retries, and never lets it reach training.
    """

    name: str = "provider"
    #: True when poll() itself waits for an event (bounded); the watcher then polls back to back.
    blocking: bool = False
    #: Seconds at the start of a failure during which the watcher retries fast (0.1-0.2 s apart), for
    #: sources whose notices leave so little time that a second of backoff matters (GCP's 30 s).
    fast_retry: float = 0.0
    #: True for a source whose check is a collective across the ranks (Ray's ``get_preemption_info``):
    #: it has no watcher thread (``channels()`` is empty); the Guard polls it from the training loop,
    #: where every rank synchronises anyway (``spotguard.guard.insync``).
    in_step: bool = False

    def open(self, report: Report) -> None:  # noqa: B027 - optional hook
        """Prepare (install handlers, open sessions). ``report`` pushes a notice out of band."""

    @abc.abstractmethod
    def poll(self) -> Notice | None:
        """Check once. Return a Notice if one is present now, else None."""

    def channels(self) -> list[NoticeProvider]:
        """What the watcher polls, each from its own thread: ``[self]`` unless the provider waits on
        several things at once. A channel is a ``NoticeProvider`` whose ``poll()``, ``blocking``,
        ``fast_retry`` and ``wakeup()`` the watcher uses; ``open``, ``acknowledge`` and ``close`` go
        to the provider itself."""
        return [self]

    def acknowledge(self, notice: Notice) -> None:  # noqa: B027 - optional hook
        """Tell the source our state is safe (called by Guard once the emergency checkpoint is
        committed; Azure approves the event so the eviction need not wait for its deadline)."""

    def wakeup(self) -> None:  # noqa: B027 - optional hook
        """Make a blocked ``poll()`` return soon; called from another thread when stopping."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``open()`` took (restore handlers, close sessions)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
