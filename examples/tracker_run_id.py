"""Keep an experiment tracker's run across preemptions: the run id lives in ``guard.extra``.

``guard.extra`` is saved in every checkpoint's manifest (as it is at the step saved) and restored by
``guard.resume()``, so the restarted job finds the id of the run it was logging to and continues it
instead of opening a new one:

    W&B:     run_id = guard.extra.get("wandb_id") or wandb.util.generate_id()
             wandb.init(project="p", id=run_id, resume="allow")
    MLflow:  run = mlflow.start_run(run_id=guard.extra.get("mlflow_run_id"))
             guard.extra["mlflow_run_id"] = run.info.run_id

Set the id before the first checkpoint (the emergency one included). Log with the step number: the
steps between the resumed checkpoint and the stop are trained and logged again after a crash, and a
tracker keyed by step (W&B's ``step=``, MLflow's ``step=``) keeps them apart. This example needs no
tracker: ``JsonLinesTracker`` writes the same calls to a file.

    python examples/tracker_run_id.py --storage checkpoints/tracked --tracker-log tracker.jsonl

Stop it with Ctrl-C while it trains (about 4 s) and start it again: tracker.jsonl shows the same run
id going on from the step it stopped at.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import torch

import spotguard


class JsonLinesTracker:
    """Stands in for ``wandb.init(id=..., resume="allow")`` / ``mlflow.start_run(run_id=...)``."""

    def __init__(self, path: str, run_id: str, resumed: bool, step: int) -> None:
        self.path, self.run_id = path, run_id
        self._write({"run_id": run_id, "resumed": resumed, "start_step": step})

    def log(self, step: int, **metrics: float) -> None:
        self._write({"run_id": self.run_id, "step": step, **metrics})

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", default="checkpoints/tracked")
    p.add_argument("--tracker-log", default="tracker.jsonl")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-steps", type=int, default=50)
    p.add_argument("--providers", default="auto")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.02,
        help="extra seconds per step: the default gives the 200 steps about 4 s, time to stop the job with "
        "Ctrl-C and see the next start continue the tracker run (0: as fast as the CPU goes)",
    )
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = spotguard.Guard(args.storage, every_steps=args.every_steps, providers=args.providers)
    guard.track(model=model, optimizer=opt)
    start = guard.resume()
    run_id = guard.extra.get("tracker_run_id")
    resumed = run_id is not None
    if run_id is None:  # the first start: a new tracker run, and its id goes into every checkpoint
        run_id = guard.extra["tracker_run_id"] = uuid.uuid4().hex[:12]
    tracker = JsonLinesTracker(args.tracker_log, run_id, resumed, start)
    print(f"{'continuing' if resumed else 'new'} tracker run {run_id} at step {start}", flush=True)
    gen = torch.Generator().manual_seed(1)
    with guard:
        for step in range(start + 1, args.steps + 1):
            x = torch.randn(32, 8, generator=gen)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            tracker.log(step, loss=loss.item())
            time.sleep(args.step_sleep)
            if guard.step(step):
                print(f"stopped at step {step}; tracker run {run_id} goes on at the next start", flush=True)
                return spotguard.EXIT_PREEMPTED
    print(f"finished tracker run {run_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
