"""The retry policy shared by the cloud backends: jittered exponential backoff from a private RNG,
bounded by attempts and by the caller's deadline; permanent errors are not retried."""

from __future__ import annotations

import random
import time

import pytest

from spotguard.errors import ConfigError, StorageError
from spotguard.storage import retry
from spotguard.storage.retry import JitteredBackoff, RetryOptions


def test_backoff_grows_with_jitter_and_is_capped_without_touching_global_random():
    random.seed(3)
    before = random.getstate()
    wait = JitteredBackoff(RetryOptions(initial=1.0, maximum=8.0, multiplier=2.0))
    delays = {n: [wait.delay(n) for _ in range(200)] for n in range(1, 7)}
    for n, ds in delays.items():
        step = min(8.0, 2.0 ** (n - 1))
        assert all(step / 2 <= d <= step for d in ds)
        assert len(set(ds)) > 100  # jittered, not fixed
    assert random.getstate() == before


def test_transient_errors_are_retried_and_permanent_ones_are_not():
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    opts = RetryOptions(attempts=5, initial=0.001, maximum=0.002)
    assert retry.call(flaky, options=opts, transient=lambda e: isinstance(e, ConnectionError)) == "ok"
    assert len(calls) == 3

    calls.clear()

    def denied() -> None:
        calls.append(1)
        raise PermissionError("403")

    with pytest.raises(PermissionError):
        retry.call(denied, options=opts, transient=lambda e: isinstance(e, ConnectionError))
    assert len(calls) == 1


def test_attempts_and_deadline_bound_the_retries():
    calls = []

    def down() -> None:
        calls.append(time.monotonic())
        raise TimeoutError("down")

    with pytest.raises(TimeoutError):
        retry.call(down, options=RetryOptions(attempts=4, initial=0.001, maximum=0.001), transient=lambda e: True)
    assert len(calls) == 4

    calls.clear()
    t0 = time.monotonic()
    # The last attempt's error, or (when that attempt ends just past the deadline on a loaded machine)
    # the deadline's own StorageError: either way the caller hears at the deadline.
    with pytest.raises((TimeoutError, StorageError)):
        retry.call(
            down,
            options=RetryOptions(attempts=1000, initial=0.1, maximum=0.1),
            transient=lambda e: True,
            deadline=t0 + 0.5,
        )
    assert time.monotonic() - t0 < 1.5  # stopped at the deadline (0.5 s), not after 1000 attempts (50 s and more)
    assert 3 <= len(calls) <= 10


@pytest.mark.parametrize("kw", [{"attempts": 0}, {"initial": -1}, {"maximum": 0.01, "initial": 1}, {"multiplier": 0.5}])
def test_bad_options_are_rejected(kw):
    with pytest.raises(ConfigError):
        RetryOptions(**kw)
