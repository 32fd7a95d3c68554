"""Ray Train on spot machines: Ray restarts the workers, spotguard makes the restart lose nothing.

    pip install 'ray[train]' 'spotguard[aws]'
    SPOTGUARD_STORAGE=s3://my-bucket/runs/ray-1 python examples/ray/train_ray.py --workers 4 --gpu

How the two divide the work: Ray Train starts the workers (one torch.distributed process group)
and, with ``FailureConfig(max_failures=-1)``, starts them again after any failure, on new nodes
when a node is gone. Each worker runs an ordinary ``spotguard.Guard`` loop: the ranks agree on the
step to stop at when any of them sees a notice (cloud metadata, SIGTERM), write one sharded
emergency checkpoint to the bucket, and raise ``Preempted`` so that Ray counts an attempt and
restarts the group; ``guard.resume()`` on the new attempt continues from that step exactly.
Checkpoints go to spotguard storage (manifest last, checksums), not to Ray's checkpoint API.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import spotguard


class Preempted(RuntimeError):
    """Raised after the emergency checkpoint is committed: Ray Train counts a failure and restarts."""


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = ray.train.torch.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=64))
    # Every rank builds the same Guard; in Ray's process group the ranks agree on stops and save sharded.
    guard = spotguard.Guard(config["storage"], every_steps=config["every_steps"], providers="auto")
    guard.track(model=model, optimizer=opt)
    step = guard.resume()
    with guard:
        while step < config["steps"]:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if guard.step(step):
                    raise Preempted(f"stopped at step {step} for a notice; checkpoint committed")
                if step % 100 == 0:
                    ray.train.report({"step": step, "loss": loss.item()})
                if step >= config["steps"]:
                    break


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage", default=os.environ.get("SPOTGUARD_STORAGE"), help="s3:// or gs:// URL")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every-steps", type=int, default=500)
    args = p.parse_args(argv)
    if not args.storage:
        p.error("--storage or $SPOTGUARD_STORAGE: every worker must reach the same bucket")

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"storage": args.storage, "steps": args.steps, "every_steps": args.every_steps, "seed": 0},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        # -1: restart after every failure, a preemption included; spotguard makes each restart exact.
        run_config=RunConfig(name="spotguard-ray", failure_config=FailureConfig(max_failures=-1)),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
