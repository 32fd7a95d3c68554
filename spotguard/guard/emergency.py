"""The emergency decision: what a stop does with a periodic save still in flight.

Pure: it gets the time left and the measured estimates, and returns a decision; the guard's
``Saves`` carries it out. Kept apart so that the rules can be read (and tested) in one place.
"""

from __future__ import annotations

import enum

FIT = 0.9  # share of the time left that an estimated save may use (estimates are rough)
CANCEL_GRACE_S = 1.0  # how long an emergency waits for an abandoned save to notice
#: An emergency save whose deadline has passed (a long step, a user's stale deadline) or is about to
#: still gets this long, best effort: the machine is still here, and "not started" loses the work.
#: Short enough not to distort a real short deadline (a pod's grace period); long enough for one
#: request (S3's shortest request timeout under a deadline is 5 s too).
EMERGENCY_FLOOR_S = 5.0


class Inflight(enum.IntEnum):
    """An emergency's decision on a periodic save in flight; ordered so that MAX is the most cautious."""

    NONE = 0  # nothing in flight
    SAME = 1  # the in-flight save is of the stop step itself: wait for it
    WAIT = 2  # both fit before the deadline: wait for it, then write the emergency checkpoint
    ABANDON = 3  # the newer state wins: cancel it, write the emergency checkpoint
    KEEP = 4  # the emergency checkpoint cannot fit: let it commit, it is the resume point


def time_given(left: float | None) -> float | None:
    """The seconds the emergency save gets: what the notice leaves, but never less than the floor."""
    return None if left is None else max(left, EMERGENCY_FLOOR_S)


def decide(
    in_flight_step: int | None, stop_step: int, left: float | None, fresh: float | None, rest: float | None
) -> Inflight:
    """What to do with the save of ``in_flight_step`` (None: nothing in flight) when stopping at ``stop_step``.

    ``left``: seconds to the deadline (None: no deadline known); ``fresh``: estimated seconds to
    write the emergency checkpoint; ``rest``: estimated seconds until the in-flight save commits
    (both None when not measured yet). Both fit in the time left: wait for it, then write the
    emergency checkpoint. The emergency one cannot fit: keep the in-flight one (unless it is known
    to miss too), it stays the resume point. Otherwise, or with nothing measured or no deadline,
    the newer state wins: abandon it.
    """
    if in_flight_step is None:
        return Inflight.NONE
    if in_flight_step == stop_step:
        return Inflight.SAME
    if left is not None and fresh is not None:
        left = max(left, 0.0)
        if rest is not None and rest + fresh <= left * FIT:
            return Inflight.WAIT
        if fresh > left * FIT and (rest is None or rest <= left):
            return Inflight.KEEP
    return Inflight.ABANDON
