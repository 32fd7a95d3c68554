"""Ray Train on spot machines: Ray restarts the workers, spotguard makes the restart lose nothing.

    pip install 'ray[train]' 'spotguard[aws,data]'
    SPOTGUARD_STORAGE=s3://my-bucket/runs/ray-1 python examples/ray/train_ray.py --workers 4 --gpu
    python examples/ray/train_ray.py --storage checkpoints/ray --local-cpus 2   # a local rehearsal

How the two divide the work: Ray Train starts the workers (one torch.distributed process group) and
starts them again after a failure, on new nodes when a node is gone. Each worker runs an ordinary
``spotguard.Guard`` loop. Its notices come from the cluster's drain of a reclaimed node (Ray Train's
``get_preemption_info()``, found by ``providers="auto"`` in a worker and polled inside the ranks'
step vote), from cloud metadata on each node's local rank 0, and from a per-rank
``$SPOTGUARD_NOTICE_FILE`` like ``/tmp/notice-{rank}``. When any of them announces a stop, every rank
stops after the same step and writes one sharded emergency checkpoint to the bucket before the
earliest deadline; ``guard.resume()`` on the next attempt continues from that step exactly.

How the attempt ends is ``spotguard.integrations.ray.end_attempt``: after a drain Ray announced, the
workers wait for Ray Train to end the attempt as a preemption (charged to
``FailureConfig.max_preemption_failures``, unlimited here); after a notice Ray knows nothing of they
raise ``Preempted``, an ordinary failure (``max_failures``). Checkpoints go to spotguard storage
(manifest last, checksums), not to Ray's checkpoint API.

Ray runs the training function in a thread of its worker process, where no signal handler can be
set: a SIGTERM to a worker is Ray's business (it ends the worker), not a notice. A SIGTERM to a
``ray start --block`` node drains the node (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``): that is a
notice, through Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
import torch
from torch import nn

import spotguard
from spotguard.integrations.ray import end_attempt


def _log(path: str | None, rank: int, record: dict) -> None:
    if path:
        with open(path.format(rank=rank), "a") as f:
            f.write(json.dumps(record) + "\n")


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    torch.manual_seed(config["seed"] + rank)  # each rank its own dropout stream; DDP broadcasts rank 0's weights
    random.seed(config["seed"] + rank)  # every stream the Guard saves is seeded: two runs' checkpoints are equal
    np.random.seed(config["seed"] + rank)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    model = ray.train.torch.prepare_model(model)  # to this worker's device, in DDP when there are several
    device = ray.train.torch.get_device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(config["seed"])
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))
    # Not ray.train.torch.prepare_data_loader: it rebuilds a plain DataLoader, whose position cannot be
    # saved. A StatefulDataLoader over a DistributedSampler resumes mid-epoch.
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"])
    loader = StatefulDataLoader(data, batch_size=64, sampler=sampler, drop_last=True)
    # Every rank builds the same Guard; in Ray's process group the ranks agree on stops and save sharded.
    guard = spotguard.Guard(
        config["storage"], every_steps=config["every_steps"], providers="auto", interval=config["interval"]
    )
    guard.track(model=model, optimizer=opt, loader=loader)
    step = start = guard.resume()
    epoch = int(guard.extra.get("epoch", 0))
    _log(config["trace"], rank, {"event": "train_begin", "step": start, "pid": os.getpid()})
    with guard:
        while step < config["steps"] and guard.stopped_at is None:
            sampler.set_epoch(epoch)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                _log(config["losses"], rank, {"step": step, "loss": loss.item().hex()})
                time.sleep(config["step_sleep"])
                if guard.step(step):
                    break
                if step % 100 == 0:
                    ray.train.report({"step": step, "loss": loss.item()})
                if step >= config["steps"]:
                    break
            else:
                epoch += 1
                guard.extra["epoch"] = epoch
    if guard.stopped_at is not None:  # the checkpoint of this step is committed; the guard is closed
        _log(config["trace"], rank, {"event": "preempted", "step": step, "by": guard.notice and guard.notice.provider})
        end_attempt(guard)  # never returns: Ray ends the attempt (a preemption), or it raises (a failure)
    if config["final"] and rank == 0:
        torch.save(
            {"model": getattr(model, "module", model).state_dict(), "optimizer": opt.state_dict()}, config["final"]
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", default=os.environ.get("SPOTGUARD_STORAGE"), help="s3:// or gs:// URL")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every-steps", type=int, default=500)
    p.add_argument("--interval", type=float, default=1.0, help="notice polling interval (s)")
    p.add_argument("--local-cpus", type=int, help="start a local Ray cluster of this many CPUs (else ray.init())")
    p.add_argument(
        "--address", help="the Ray cluster to join (ray.init(address=...)); default: RAY_ADDRESS or a new one"
    )
    p.add_argument("--max-failures", type=int, default=3, help="restarts after ordinary failures (-1: no limit)")
    p.add_argument("--max-preemptions", type=int, default=-1, help="restarts after Ray's preemptions (-1: no limit)")
    p.add_argument("--results", help="where Ray Train keeps its run state (RunConfig.storage_path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--losses", help="per-rank JSON lines {step, loss}; '{rank}' in the path is filled in")
    p.add_argument("--trace", help="per-rank JSON lines of attempts (train_begin, preempted); '{rank}' filled in")
    p.add_argument("--final", help="rank 0 saves the model and optimizer state here at the end (torch.save)")
    args = p.parse_args(argv)
    if not args.storage:
        p.error("--storage or $SPOTGUARD_STORAGE: every worker must reach the same bucket")

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if args.local_cpus:
        ray.init(num_cpus=args.local_cpus, include_dashboard=False)
    elif args.address:
        ray.init(address=args.address)
    config = {
        "storage": args.storage,
        "steps": args.steps,
        "every_steps": args.every_steps or None,
        "interval": args.interval,
        "seed": args.seed,
        "step_sleep": args.step_sleep,
        "losses": args.losses,
        "trace": args.trace,
        "final": args.final,
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        # A preemption Ray announced is charged to its own budget, not to max_failures (end_attempt);
        # spotguard makes each restart exact.
        run_config=RunConfig(
            name="spotguard-ray",
            storage_path=args.results,
            failure_config=FailureConfig(max_failures=args.max_failures, max_preemption_failures=args.max_preemptions),
        ),
    )
    try:
        trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
