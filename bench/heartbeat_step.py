"""Cost of the supervisor heartbeat on ``Guard.step()`` when nothing is due.

Our figure: ``guard.step(n)`` with ``$SPOTGUARD_HEARTBEAT`` set (an mmap'd write per step).
Baseline, measured in the same run: the same method without the heartbeat write (the code before
the heartbeat existed). Prints both, and the ratio.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rows import emit, parser, row  # noqa: E402

import spotguard  # noqa: E402
from spotguard import heartbeat  # noqa: E402
from spotguard.coordination.agreement import ADVISORY, PERIODIC, STOP  # noqa: E402

N, REPEAT = 1_000_000, 7


class _BeforeHeartbeat(spotguard.Guard):
    def step(self, step: int) -> bool:  # Guard.step() without `self._beat[0] = step`
        self._step = step
        if self.agreement is not None:
            return self._vote(step)
        s = self.schedule
        if self.preempted.is_set() or step >= s.due_step or (s.timed and time.monotonic() >= s.due_time):
            return self._act(STOP if self.preempted.is_set() else ADVISORY if s.advisory else PERIODIC, step)
        return False


def per_call(guard: spotguard.Guard) -> float:
    return min(timeit.repeat("g.step(5)", globals={"g": guard}, number=N, repeat=REPEAT)) / N


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    with tempfile.TemporaryDirectory() as d:
        beat = heartbeat.create(os.path.join(d, "heartbeat"))
        baseline = per_call(_BeforeHeartbeat(os.path.join(d, "a"), every_steps=10**9, providers=None))
        plain = per_call(spotguard.Guard(os.path.join(d, "b"), every_steps=10**9, providers=None))
        os.environ[heartbeat.HEARTBEAT_ENV] = str(beat)
        ours = per_call(spotguard.Guard(os.path.join(d, "c"), every_steps=10**9, providers=None))
        assert heartbeat.read(beat)[0] == 5  # the supervisor sees the step
    print(f"guard.step() with heartbeat (mmap):    {ours * 1e9:7.1f} ns")
    print(f"guard.step() without supervisor:       {plain * 1e9:7.1f} ns")
    print(f"baseline: step() before the heartbeat: {baseline * 1e9:7.1f} ns")
    print(f"ratio (ours / baseline):               {ours / baseline:7.2f}x")
    emit(
        [
            row(
                "guard.step() under `spotguard run` (heartbeat write)",
                ours * 1e9,
                "ns",
                baseline=baseline * 1e9,
                baseline_label="step() before the heartbeat",
                target="< 1 us",
                passed=lambda v, r: v < 1000,
            )
        ],
        args.json,
    )


if __name__ == "__main__":
    main()
