"""Retries shared by the cloud backends: tenacity, exponential backoff with private jitter, a deadline.

Why not tenacity's own ``wait_random_exponential``: it draws from the global ``random`` module,
which is the training's random stream. ``JitteredBackoff`` draws from its own ``random.Random``.
Why a deadline: an emergency save has until the notice deadline (a ``time.monotonic()`` value);
no retry may sleep past it. Permanent errors (403, missing bucket) are never retried.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from ..errors import ConfigError, StorageError
from ._common import check_fields

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RetryOptions:
    """How hard to retry a transient failure (5xx, throttling, reset, timeout)."""

    attempts: int = 6  # per operation, first try included
    initial: float = 0.2  # seconds before the first retry (before jitter)
    maximum: float = 10.0  # longest single wait
    multiplier: float = 2.0
    max_elapsed: float = 300.0  # give up after this long even without a deadline

    def __post_init__(self) -> None:
        check_fields(self, ints={"attempts": 1}, positive=("maximum", "multiplier"))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (self.initial, self.max_elapsed))
        if not numbers or not 0 <= self.initial <= self.maximum or self.multiplier < 1 or not self.max_elapsed > 0:
            raise ConfigError(f"invalid retry timing {self!r}")  # max_elapsed may be inf: no time cap


class JitteredBackoff(wait_base):
    """Exponential backoff with "equal jitter": half the step fixed, half random (private RNG)."""

    def __init__(self, options: RetryOptions, rng: random.Random | None = None) -> None:
        self.options = options
        self.rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        o = self.options
        step = min(o.maximum, o.initial * o.multiplier ** max(0, attempt - 1))
        return step / 2 + self.rng.uniform(0, step / 2)

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)


class StopAtDeadline(stop_base):
    """Stop when the next sleep would end past ``deadline`` (monotonic), or after the attempt/time caps."""

    def __init__(self, options: RetryOptions, deadline: float | None) -> None:
        self.options = options
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        if retry_state.attempt_number >= self.options.attempts:
            return True
        now = time.monotonic()
        wake = now + (retry_state.upcoming_sleep or 0.0)
        if self.deadline is not None and wake >= self.deadline:
            return True
        return wake - retry_state.start_time >= self.options.max_elapsed


def call(
    fn: Callable[[], T],
    *,
    options: RetryOptions,
    transient: Callable[[BaseException], bool],
    deadline: float | None = None,
    what: str = "request",
    wait: JitteredBackoff | None = None,
) -> T:
    """Run ``fn``; retry it while it raises a transient error. The last error is re-raised as is."""

    def log(rs: RetryCallState) -> None:
        exc = rs.outcome.exception() if rs.outcome else None
        logger.warning(
            "%s failed (attempt %d: %s: %s); retrying in %.2fs",
            what,
            rs.attempt_number,
            type(exc).__name__,
            exc,
            rs.upcoming_sleep,
        )

    retrying = Retrying(
        stop=StopAtDeadline(options, deadline),
        wait=wait or JitteredBackoff(options),
        retry=retry_if_exception(transient),
        before_sleep=log,
        reraise=True,
    )
    if deadline is None:
        return retrying(fn)
    return _until(deadline, lambda: retrying(fn), what)


def _until(deadline: float, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` in a daemon thread; give up on it at ``deadline``.

    Retries stop at the deadline, but a request already in flight (a large part, a slow commit)
    would run on past it. The caller must learn the outcome while the machine is still there, so
    it stops waiting at the deadline. An abandoned data transfer cannot commit a checkpoint (the
    manifest is written only after the data); an abandoned manifest write may still land, which
    only makes that checkpoint complete. Either ends with its client.
    """
    if deadline <= time.monotonic():
        raise StorageError(f"{what}: the deadline has passed; not started")
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller below
            box["error"] = e
        finally:
            done.set()

    # A daemon thread, not an executor: executor threads are joined at exit, and an abandoned
    # transfer must never hold the process past its deadline.
    threading.Thread(target=run, name="spotguard-deadline", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise StorageError(f"{what}: still running at the deadline; abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def remaining(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (None: no deadline)."""
    return None if deadline is None else deadline - time.monotonic()
