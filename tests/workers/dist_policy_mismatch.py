"""Worker for tests/integrations/test_window.py (2 plain processes, gloo): ranks that disagree on the
deadline policy must all raise ``ConfigError`` when their agreement is made, never hang at a vote.

Cases, reported with ``emit`` as ``{case, raised, message}``: ``guard`` (a ``Guard`` with
``deadline_policy`` "use-window" on rank 0 and "stop" on rank 1), ``integration`` (an integration's
``NoticeWatch`` with the policy from ``$SPOTGUARD_DEADLINE_POLICY``, set on rank 1 only). Where
nothing is raised, the ranks go on to a vote, as a job would.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

import spotguard
from spotguard.errors import ConfigError
from spotguard.integrations._common import NoticeWatch
from tests.workers.results import emit


def attempt(out: str, case: str, make) -> None:
    try:
        made = make()
    except ConfigError as e:
        emit(out, case=case, raised=True, message=str(e))
        return
    emit(out, case=case, raised=False, message="")
    made()  # what a made agreement does next: a vote every rank must reach


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def guard():
        g = spotguard.Guard(root, providers=[], lease_ttl=None, deadline_policy="use-window" if rank == 0 else "stop")
        return g.close

    attempt(out, "guard", guard)

    def integration():
        if rank == 1:
            os.environ["SPOTGUARD_DEADLINE_POLICY"] = "use-window"
        watch = NoticeWatch(providers=[])
        try:
            watch.start()  # makes the group's agreement (collective)
        finally:
            os.environ.pop("SPOTGUARD_DEADLINE_POLICY", None)
            watch.watcher.stop()
        return lambda: (watch.check(1), watch.group.close())

    attempt(out, "integration", integration)

    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
