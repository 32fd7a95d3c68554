"""Driver for test_crash_async: forks trainees from one warm process and SIGKILLs them at random.

Run as a script: ``python crash_driver.py STORAGE LOG KILLS SEED``. Importing torch once and
forking each trainee (single-threaded: torch.set_num_threads(1) before any work) makes fifty
kill-and-resume rounds take seconds instead of minutes. Prints one JSON summary line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

STEPS = 150


def train(storage: str, log: str, steps: int = STEPS) -> None:
    """A trainee: resume, train with async saves every step, log each step's loss exactly."""
    import spotguard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )  # ~8 MB with AdamW state: saves take a while
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = spotguard.Guard(storage, providers=[], every_steps=1, keep=2)
    guard.track(model=model, optimizer=opt)
    start = guard.resume()
    with open(log, "a") as f, guard:
        for step in range(start, steps):
            x = torch.randn(32, 256)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            f.write(json.dumps({"step": step + 1, "loss": loss.item().hex()}) + "\n")
            f.flush()
            guard.step(step + 1)


def lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def scratch(storage: str) -> list[str]:
    """Scratch files of unfinished writes (none yet when the first trainee died before its first save)."""
    try:
        return [n for n in os.listdir(storage) if n.startswith(".spotguard.tmp-")]
    except FileNotFoundError:
        return []


def run_child(storage: str, log: str, kill: tuple[int, float] | None) -> int:
    """Fork a trainee; with ``kill=(k, t)``, SIGKILL it ``t`` seconds after it logged ``k`` steps.

    Counting steps, not seconds from the fork, keeps the kills inside training and its background
    saves (one is started at every step) however fast or loaded the machine is.
    """
    before = lines(log)
    pid = os.fork()
    if pid == 0:
        try:
            train(storage, log)
        finally:
            os._exit(0)
    if kill is not None:
        steps, delay = kill
        deadline = time.monotonic() + 60
        while lines(log) < before + steps and time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:  # finished (nothing left to train) before the kill
                return status
            time.sleep(0.001)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


def main() -> int:
    storage, log, kills, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    rng = random.Random(seed)
    import spotguard  # noqa: F401 - warm: trainees start in milliseconds
    from spotguard.storage import local_leftovers

    local_leftovers.LEFTOVER_GRACE_S = 0.0  # this run's kills are seconds apart; trainees inherit the setting
    # Warm: the first AdamW in a process imports more of torch (~1 s); children inherit it.
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()).step()
    from spotguard import checkpoint
    from spotguard.storage import open_storage

    store = open_storage(storage)
    partial = corrupt = most_scratch = 0
    for _ in range(kills):
        run_child(storage, log, (rng.randint(1, 3), rng.uniform(0.0, 0.03)))
        infos = checkpoint.scan(store)
        corrupt += sum(i.status == "corrupt" for i in infos)
        # Each save sweeps the scratch of killed writers, so what is here now is this kill's.
        left = scratch(storage)
        most_scratch = max(most_scratch, len(left))
        partial += bool(left) or any(i.status == "incomplete" for i in infos)
        for info in infos:
            if info.complete:
                checkpoint.verify(store, info)  # raises on a bad checksum
    status = run_child(storage, log, None)
    infos = checkpoint.scan(store)
    print(
        json.dumps(
            {
                "partial": partial,
                "corrupt": corrupt,
                "final_status": status,
                "most_scratch": most_scratch,
                "scratch_left": len(scratch(storage)),
                "incomplete_left": sum(not i.complete for i in infos),
            }
        )
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--reference":
        torch.set_num_threads(1)
        train(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
