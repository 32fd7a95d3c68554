"""``spotguard run``: start a training command, restart it after a crash or a hang, never after a preemption.

Order of one run: report the newest complete checkpoint -> start the child in its own process
group with ``$SPOTGUARD_STORAGE`` and ``$SPOTGUARD_HEARTBEAT`` set (``child``) -> watch its exit,
its heartbeat and our stop signals (``child``, ``signals``) -> once it exited, stop whatever it
left running, ranks of a launcher included (``procs``) -> decide (``loop``):

=====================================================  ============================================
child outcome                                          supervisor
=====================================================  ============================================
exit 0                                                 exit 0 (finished)
its Guard stopped for a notice and committed its       exit 75, no restart: the machine can go
checkpoint (heartbeat flags), whatever the code
(a launcher's own code, e.g. torchrun's 1); or exit
75 from a job without a Guard
its Guard stopped for a notice but reported no         its own code (1 for a 0 or 75 that would
committed checkpoint (killed mid-save, save failed)    claim one), no restart; the log says what
                                                       was lost
exit 78 (``EXIT_CONFIG``) or its Guard raised an       exit 78, no restart: a restart meets the same
error a restart meets again (heartbeat flag)           error (unloadable state, changed data loader)
exit 73 (``EXIT_LEASE_HELD``) or its Guard found       exit 73, no restart: a restart meets the same
another job holding the storage's writer lease, or     writer (``spotguard run --takeover`` takes the
lost it to one (heartbeat flag)                        lease over on purpose)
any other exit, killed by a signal, or hung            restart after a backoff while the budget lasts,
                                                       then ``RestartBudgetExhausted`` (CLI: exit 2)
we got SIGTERM/SIGINT/SIGUSR1 (forwarded to the        the child's code once it and all it left
child, which writes its emergency checkpoint)          running exited (128+N if signal N killed it);
                                                       after ``grace`` seconds every process of the
                                                       job is killed, exit 128+signal
=====================================================  ============================================

``spotguard.ops.supervisor.metrics`` exports the starts and exits; ``Supervisor.summary()`` is the document
``spotguard run --json`` prints. Nothing here imports torch.
"""

from .child import Outcome
from .loop import CAUSES, RESTARTED, RestartBudgetExhausted, Supervisor
from .options import SupervisorOptions, signame, to_signal
from .signals import DUPLICATE_WINDOW, FORWARDED

__all__ = [
    "CAUSES",
    "DUPLICATE_WINDOW",
    "FORWARDED",
    "RESTARTED",
    "Outcome",
    "RestartBudgetExhausted",
    "Supervisor",
    "SupervisorOptions",
    "signame",
    "to_signal",
]
