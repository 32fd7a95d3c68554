"""The emergency decision and the estimate it is fed, without a training loop."""

from __future__ import annotations

import pytest

from spotguard.guard.emergency import EMERGENCY_FLOOR_S, Inflight, decide, time_given
from spotguard.guard.stats import GuardStats


def test_nothing_in_flight_or_the_stop_step_itself():
    assert decide(None, 10, 30.0, 1.0, 1.0) is Inflight.NONE
    assert decide(10, 10, 30.0, 1.0, 1.0) is Inflight.SAME


@pytest.mark.parametrize(
    ("left", "fresh", "rest", "expected"),
    [
        (30.0, 5.0, 5.0, Inflight.WAIT),  # both fit in 90% of the time left
        (30.0, 28.0, 1.0, Inflight.KEEP),  # the emergency save cannot fit: the in-flight one is the resume point
        (30.0, 28.0, None, Inflight.KEEP),  # its remaining time unknown: still the only chance
        (30.0, 28.0, 40.0, Inflight.ABANDON),  # it misses too: the newer state wins
        (30.0, 20.0, 10.0, Inflight.ABANDON),  # each fits alone, not both
        (30.0, None, 1.0, Inflight.ABANDON),  # nothing measured
        (None, 1.0, 1.0, Inflight.ABANDON),  # no deadline known
        (-5.0, 1.0, 0.0, Inflight.KEEP),  # past the deadline: nothing new can fit
    ],
)
def test_an_older_save_in_flight_is_waited_for_kept_or_abandoned(left, fresh, rest, expected):
    assert decide(7, 10, left, fresh, rest) is expected


def test_the_emergency_save_always_gets_the_floor():
    assert time_given(None) is None
    assert time_given(0.5) == EMERGENCY_FLOOR_S and time_given(-3.0) == EMERGENCY_FLOOR_S
    assert time_given(60.0) == 60.0


def test_a_snapshot_does_not_replace_the_size_a_write_measured():
    """In a process group a rank snapshots its own part, while a write counts every rank's files at
    the rate of all of them: once a write is measured, the estimate keeps its size."""
    st = GuardStats()
    st.record_snapshot(0.1, 400)  # before any write: the best guess there is
    assert st.state_bytes == 400
    st.record_write(2.0, 1000)  # 2 ranks wrote 1000 bytes in 2 s
    st.record_snapshot(0.1, 500)  # one rank's next snapshot
    assert st.state_bytes == 1000 and st.durable_seconds() == pytest.approx(2.0)
