"""A job for the writer-lease tests: a counter as its state, a synchronous checkpoint every 2 steps
with its name in each manifest (``guard.extra["writer"]``), one step per ``--sleep`` seconds.

Writes ``--ready`` once it resumed and committed its first checkpoint; exits 75 after a stop notice
(SIGTERM; ``--linger`` seconds later), else 0; an error (``LeaseHeldError``, ``LeaseLostError``) ends it with a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from spotguard import EXIT_PREEMPTED, Guard

p = argparse.ArgumentParser()
p.add_argument("storage")
p.add_argument("--name", required=True)
p.add_argument("--steps", type=int, default=10**6)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--ttl", type=float, default=60.0)
p.add_argument("--ready")
p.add_argument("--linger", type=float, default=0.0, help="after a stop, seconds before the guard is closed")
args = p.parse_args()

guard = Guard(args.storage, every_steps=2, keep=10**6, async_save=False, lease_ttl=args.ttl, providers=["signal"])
state = {"count": 0}
guard.track(state=state)
start = guard.resume()
print(f"{args.name}: resumed at step {start}", flush=True)
guard.extra["writer"] = args.name
with guard:
    for step in range(start + 1, start + args.steps + 1):
        state["count"] += 1
        time.sleep(args.sleep)
        if guard.step(step):
            time.sleep(args.linger)  # a machine reclaimed before the program gets to close the guard
            break
        if args.ready and step == start + 2:
            Path(args.ready).write_text(str(step))
print(f"{args.name}: done at step {guard.last_step}", flush=True)
sys.exit(EXIT_PREEMPTED if guard.stopped_at is not None else 0)
