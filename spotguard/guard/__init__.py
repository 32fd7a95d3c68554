"""The training loop's side: the ``Guard`` facade and what it is made of.

``guard`` (the facade) -> ``schedule`` (when a save is due) -> ``emergency`` (what a stop does with
a save in flight) -> ``window`` (training on in a notice's window) -> ``pending`` (a save written in
the background) -> ``agreement`` (the rank vote in a process group); ``stats`` holds what was measured. Checkpoint engines live in
``spotguard.checkpoint``; none of them sees the Guard.
"""

from spotguard.guard.guard import Guard
from spotguard.guard.options import BusyPolicy, GuardOptions
from spotguard.heartbeat import EXIT_CONFIG, EXIT_LEASE_HELD, EXIT_PREEMPTED

__all__ = ["EXIT_CONFIG", "EXIT_LEASE_HELD", "EXIT_PREEMPTED", "BusyPolicy", "Guard", "GuardOptions"]
