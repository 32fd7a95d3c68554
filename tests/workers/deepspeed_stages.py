"""Several DeepSpeed jobs in one torchrun launch (a launch costs ~20 s of imports and start-up here).

For each ``--resume`` stage: train examples/deepspeed_train.py's job to step 20 with a checkpoint at
step 12, then build a fresh engine, resume it from that checkpoint, train 12..20 again; each rank emits
{stage, resumed, first, second, weights_same} (losses as float.hex) to OUT_DIR. For each ``--reference``
stage: an uninterrupted run of the example's job with the test's arguments (``--steps``,
``--every-steps``), leaving ``zero<N>/loss-{rank}.jsonl`` and ``zero<N>/final.pt`` in OUT_DIR. With
``--refuse``: rank 1 tracks state that does not load with ``weights_only=True``; each rank emits {refused}.
With ``--untracked``: a fresh engine that lacks what ``--resume 0``'s checkpoint saved resumes it; each rank
emits {untracked, accepted}. With ``--rebatch``: a loader of batch size 4 resumes it (saved with 8); each rank
emits {rebatch: the refusal, rebatch_accepted: the step resumed with ``rebatch="accept"``}.

Run: torchrun --nproc-per-node 2 ... deepspeed_stages.py OUT_DIR [--resume 0 1] [--reference 2 3 --steps 40] [--refuse] [--untracked] [--rebatch]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from deepspeed_train import exit_process, final_weights, make_job, parse_args, setup, train  # noqa: E402

from spotguard.errors import CheckpointMismatchError, ConfigError  # noqa: E402
from spotguard.integrations.deepspeed import DeepSpeedGuard  # noqa: E402
from tests.workers.results import emit  # noqa: E402


class Losses:
    """A file-like log that keeps the (step, loss) lines ``train`` writes."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line.strip())

    def flush(self) -> None:
        pass


def one_pass(argv: list[str], storage: Path, every_steps: int, log: Any) -> tuple[int, dict[str, torch.Tensor]]:
    """The example's job from the newest checkpoint in ``storage``; (resumed step, final weights)."""
    args = parse_args([*argv, "--quiet"])
    engine, loader, sampler = make_job(args)
    guard = DeepSpeedGuard(engine, str(storage), every_steps=every_steps, save_on_exit=False, providers="signal")
    guard.track(loader=loader)
    start = guard.resume()
    with guard:
        train(args, engine, loader, sampler, guard, start, log)
    return start, final_weights(engine)


class Scaler:
    """Tracked state that pickles but does not load with weights_only=True: DeepSpeed's own LossScaler."""

    def __init__(self) -> None:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler

        self.scaler = LossScaler(1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler = state["scaler"]


def refuse_unloadable(out: Path) -> None:
    """Rank 1 alone tracks a LossScaler: the first save must fail on both ranks, nothing committed."""
    engine, loader, _ = make_job(parse_args(["--zero-stage", "2", "--quiet"]))
    guard = DeepSpeedGuard(engine, str(out / "refused"), providers="signal")
    guard.track(loader=loader)
    if torch.distributed.get_rank() == 1:
        guard.track(scaler=Scaler())
    with guard:
        try:
            guard.save(1)
            outcome = "saved"
        except ConfigError as e:
            outcome = f"{type(e).__name__}: {e}"
    emit(out, refused=outcome)


def refuse_untracked(out: Path) -> None:
    """A fresh engine without the saved lr_scheduler, with no loader tracked, resumes resume-zero0's
    checkpoint: refused on both ranks, naming both; with ``untracked="accept"`` it resumes. Each rank emits
    {untracked: the refusal, accepted: the step resumed then}."""
    import deepspeed_train

    full = deepspeed_train.ds_config
    deepspeed_train.ds_config = lambda a: {k: v for k, v in full(a).items() if k != "scheduler"}
    try:
        engine, _, _ = make_job(parse_args(["--zero-stage", "0", "--quiet"]))
    finally:
        deepspeed_train.ds_config = full
    storage = str(out / "resume-zero0")
    try:
        DeepSpeedGuard(engine, storage, providers="signal", lease_ttl=None).resume()
        outcome = "resumed"
    except CheckpointMismatchError as e:
        outcome = f"{type(e).__name__}: {e}"
    accepted = DeepSpeedGuard(engine, storage, providers="signal", lease_ttl=None, untracked="accept").resume()
    emit(out, untracked=outcome, accepted=accepted)


def refuse_rebatch(out: Path) -> None:
    """A fresh engine whose tracked loader has batch size 4 resumes resume-zero0's checkpoint (saved with 8):
    refused on both ranks, naming both sizes; with ``rebatch="accept"`` it resumes."""
    engine, loader, _ = make_job(parse_args(["--zero-stage", "0", "--batch-size", "4", "--quiet"]))
    storage = str(out / "resume-zero0")
    try:
        DeepSpeedGuard(engine, storage, providers="signal", lease_ttl=None).track(loader=loader).resume()
        outcome = "resumed"
    except CheckpointMismatchError as e:
        outcome = f"{type(e).__name__}: {e}"
    accepted = DeepSpeedGuard(engine, storage, providers="signal", lease_ttl=None, rebatch="accept")
    emit(out, rebatch=outcome, rebatch_accepted=accepted.track(loader=loader).resume())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--resume", type=int, nargs="*", default=[])
    p.add_argument("--reference", type=int, nargs="*", default=[])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every-steps", type=int, default=15)
    p.add_argument("--refuse", action="store_true", help="check that unloadable tracked state fails the save")
    p.add_argument("--untracked", action="store_true", help="check that saved state nothing restores is refused")
    p.add_argument("--rebatch", action="store_true", help="check that a loader of another batch size is refused")
    opts = p.parse_args()
    setup(parse_args(["--quiet"]))
    rank = torch.distributed.get_rank()
    for stage in opts.resume:
        argv, ckpt = ["--zero-stage", str(stage), "--steps", "20"], opts.out / f"resume-zero{stage}"
        first, second = Losses(), Losses()
        _, weights = one_pass(argv, ckpt, 12, first)  # 20 steps, a checkpoint of step 12 (an epoch ends at 16)
        resumed, again = one_pass(argv, ckpt, 12, second)  # a fresh engine from step 12's checkpoint
        same = weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
        emit(opts.out, stage=stage, resumed=resumed, first=first.lines, second=second.lines, weights_same=same)
    for stage in opts.reference:
        ref = opts.out / f"zero{stage}"
        ref.mkdir(exist_ok=True)
        argv = ["--zero-stage", str(stage), "--steps", str(opts.steps)]
        with open(ref / f"loss-{rank}.jsonl", "w") as log:
            _, weights = one_pass(argv, ref / "ckpt", opts.every_steps, log)
        if rank == 0:
            torch.save(weights, ref / "final.pt")
    if opts.refuse:
        refuse_unloadable(opts.out)
    if opts.untracked:  # after --resume 0, whose checkpoint it resumes
        refuse_untracked(opts.out)
    if opts.rebatch:  # after --resume 0, whose checkpoint it resumes
        refuse_rebatch(opts.out)
    return 0


if __name__ == "__main__":
    exit_process(main)
