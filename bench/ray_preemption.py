"""Cost of Ray's preemption signal in the training loop: ``ray.train.get_preemption_info()`` on a local cluster.

Two Ray Train workers (one torch.distributed gloo group, as TorchTrainer makes) on ``ray.init(num_cpus=2)``:
the real call's round trip (a barrier through Ray's synchronisation actor), then ``guard.step()`` over
50 ms steps with the ``ray`` source polled every 2 s (the source's floor) inside the ranks' vote (``guard.insync``),
beside the same Guard without it (baseline, the same run, rounds interleaved, the least of each). Target: at most 1% of a 50 ms step.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _rows import emit, parser, row  # noqa: E402

CALLS = 200
STEPS = 200
ROUNDS = 2
STEP_S = 0.05


def _worker(config: dict) -> None:
    import ray.train
    import torch

    import spotguard

    rank = ray.train.get_context().get_world_rank()
    for _ in range(10):  # warm up
        ray.train.get_preemption_info()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        ray.train.get_preemption_info()
    call_s = (time.perf_counter() - t0) / CALLS
    step_s: dict[str, float] = {}
    for round_ in range(ROUNDS):  # interleaved, the least of each: the machine's load drifts between rounds
        for label, providers in (("baseline", ["signal"]), ("ray", ["signal", "ray"])):
            guard = spotguard.Guard(
                os.path.join(config["dir"], f"{label}-{round_}"),
                providers=providers,
                interval=1.0,
                every_steps=None,
                lease_ttl=None,
            )
            guard.track(w=torch.zeros(4))
            spent = 0.0
            with guard:
                for step in range(1, STEPS + 1):
                    time.sleep(STEP_S)
                    t = time.perf_counter()
                    guard.step(step)
                    spent += time.perf_counter() - t
            step_s[label] = min(step_s.get(label, float("inf")), spent / STEPS)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"call_s": call_s, "step_s": step_s}, f)


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "figures.json")
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": here}})
        try:
            TorchTrainer(
                _worker,
                train_loop_config={"dir": d, "out": out},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(storage_path=os.path.join(d, "results")),
            ).fit()
        finally:
            ray.shutdown()
        with open(out) as f:
            got = json.load(f)
    call_ms = got["call_s"] * 1e3
    base_ms, ray_ms = got["step_s"]["baseline"] * 1e3, got["step_s"]["ray"] * 1e3
    share = (ray_ms - base_ms) / (STEP_S * 1e3) * 100
    amortized = call_ms * STEP_S / 2.0 / (STEP_S * 1e3) * 100  # one call per 2 s of 50 ms steps
    rows = [
        row("ray.train.get_preemption_info() call, 2 workers, local cluster", call_ms, "ms"),
        row(
            "guard.step() with the ray source (polled every 2 s)",
            ray_ms,
            "ms",
            baseline=base_ms,
            baseline_label="the same Guard without it",
        ),
        row(
            "ray source's share of a 50 ms step",
            share,
            "%",
            target="<= 1%",
            passed=lambda v, _r: v <= 1.0,
        ),
    ]
    rows.append(
        row(
            "the call alone, every 2 s, as a share of a 50 ms step",
            amortized,
            "%",
            target="<= 1%",
            passed=lambda v, _r: v <= 1.0,
        )
    )
    emit(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
