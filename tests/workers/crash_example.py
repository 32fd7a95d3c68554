"""Driver for tests/checkpoint/test_crash.py: runs examples/train.py again and again, SIGKILLed at random.

``python crash_example.py STORAGE LOSSES KILLS SEED -- EXAMPLE_ARGS...``. This process imports the
example (torch, torchdata, spotguard) once and runs no torch op; each run is a forked process that
calls the example's ``main()`` with its arguments, as ``python examples/train.py`` would, without
paying seconds of imports per run. Runs alternate: SIGKILL a few steps in at a random moment, then
SIGKILL once a save is half written. After each kill the storage is scanned and every complete
checkpoint verified; a last run resumes to the end. Prints one JSON summary line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch._dynamo  # noqa: F401  # the first optimizer step imports it: seconds per run, paid once here

from spotguard import checkpoint
from spotguard.storage import open_storage
from tests.helpers import EXAMPLE, read_losses, wait_exit

spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
assert spec and spec.loader
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def has_temp_file(root: Path) -> bool:
    return root.exists() and any(".tmp-" in p.name for p in root.rglob("*"))


def start(args: list[str], err: Path) -> int:
    """Fork a run of the example's ``main(args)``: stdout discarded, stderr to ``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            sys.argv = [str(EXAMPLE), *args]
            code = example.main(args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def kill_once(args: list[str], storage: Path, losses: Path, err: Path, during_save: bool, rng: random.Random) -> dict:
    """Run the example and SIGKILL it; what the kill left in storage."""
    pid = start(args, err)
    target = len(read_losses(losses)) + rng.randint(1, 6)
    deadline = time.monotonic() + 90
    code = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:  # finished (or failed) before the kill
            code = os.waitstatus_to_exitcode(status)
            break
        if len(read_losses(losses)) >= target and (not during_save or has_temp_file(storage)):
            if not during_save:
                time.sleep(rng.uniform(0, 0.05))
            break
        time.sleep(0.0005 if during_save else 0.005)
    if code is None:
        os.kill(pid, signal.SIGKILL)
        code = wait_exit(pid, time.monotonic() + 30)
    store = open_storage(str(storage))
    infos = checkpoint.scan(store)
    for info in infos:
        if info.complete:
            checkpoint.verify(store, info)  # raises on a bad checksum
    return {
        "code": code,
        "stderr": err.read_text()[-3000:],
        "corrupt": [str(i) for i in infos if i.status == "corrupt"],
        "partial": has_temp_file(storage) or any(i.status == "incomplete" for i in infos),
    }


def main() -> int:
    storage, losses, kills, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    assert sys.argv[5] == "--"
    args = ["--storage", str(storage), "--quiet", *sys.argv[6:], "--losses", str(losses)]
    rng = random.Random(seed)
    err = storage.parent / "stderr.txt"
    rounds = [kill_once(args, storage, losses, err, i % 2 == 1, rng) for i in range(kills)]
    final = wait_exit(start([*args, "--final", str(storage.parent / "final.pt")], err), time.monotonic() + 240)
    print(json.dumps({"rounds": rounds, "final": final, "final_stderr": err.read_text()[-3000:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
