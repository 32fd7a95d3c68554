"""The training loop's side: the ``Guard`` facade and what it is made of.

``guard`` (the facade) -> ``schedule`` (when a save is due) -> ``emergency`` (what a stop does with
a save in flight) -> ``pending`` (a save written in the background); ``stats`` holds what was measured.
What the ranks share with the trainer integrations (the rank vote, the notice window, the stop
protocol, the writer lease, the common options) lives in ``spotguard.coordination``. Checkpoint
engines live in ``spotguard.checkpoint``; none of them sees the Guard.
"""

from spotguard.guard.guard import Guard
from spotguard.guard.options import BusyPolicy, GuardOptions
from spotguard.heartbeat import EXIT_CONFIG, EXIT_LEASE_HELD, EXIT_PREEMPTED

__all__ = ["EXIT_CONFIG", "EXIT_LEASE_HELD", "EXIT_PREEMPTED", "BusyPolicy", "Guard", "GuardOptions"]
