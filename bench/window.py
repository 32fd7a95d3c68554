"""Paid time idle per AWS spot preemption: deadline_policy="use-window" beside "stop", in the same run.

A training loop (a 64 MB state, steps of about 0.1 s) under a Guard polling the mock AWS metadata
service over HTTP every second (IMDSv2, as on EC2); the spot notice is triggered with its lead
shortened from 120 s to ``--notice`` (30 s) to keep the run short. Idle time is the notice lead
(trigger to the deadline in the notice) minus the training kept from it: the time the loop spent
in the steps from the trigger to the checkpoint that is resumed, guard.step() not counted. With "stop" it is
about the whole lead, so at 120 s it grows to about 120 s; with "use-window" it is the detection,
the two saves and the margin, the same whatever the lead. Lost steps: the stop step minus the step
a fresh Guard resumes. The process's own exit after its last commit is not counted here.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _rows import emit, parser, row  # noqa: E402

import spotguard  # noqa: E402
from spotguard.ops.mockmeta import MockMetadataServer, endpoint_env, make_mock  # noqa: E402
from spotguard.planner import window_reserve  # noqa: E402

STEP_S = 0.1


def one(policy: str, notice_s: float, root: Path) -> dict[str, float]:
    """One preemption under ``policy``: idle seconds of the lead, steps lost, and what the loop measured."""
    server = MockMetadataServer(make_mock("aws", warning=notice_s)).start()
    os.environ.update(endpoint_env("aws", server.url))
    try:
        state = torch.nn.Linear(4096, 4096, bias=False)  # 64 MB
        guard = spotguard.Guard(str(root), providers="aws", keep=10, deadline_policy=policy, save_on_exit=False)
        guard.track(model=state)
        trained: dict[int, float] = {}  # step -> seconds it trained (guard.step() not included)
        with guard:
            for step in range(1, 100_000):
                t0 = time.time()
                with torch.no_grad():
                    state.weight.add_(1e-3)
                time.sleep(STEP_S)
                if step == 30:
                    server.mock.trigger("spot")
                    triggered = time.time()
                trained[step] = time.time() - max(t0, triggered if step == 30 else t0)
                if guard.step(step):
                    break
        assert guard.notice is not None and guard.notice.deadline is not None
        lead = guard.notice.deadline.timestamp() - triggered
        resumed = spotguard.Guard(str(root), providers=[]).track(model=torch.nn.Linear(4096, 4096, bias=False))
        resume_step = resumed.resume()
        kept = sum(trained[s] for s in range(30, resume_step + 1))
        return {
            "idle_s": lead - kept,
            "lead_s": lead,
            "lost": step - resume_step,
            "kept": resume_step - 30,
            "step_s": statistics.median(trained[s] for s in range(1, 30)),
            "save_s": guard.stats().emergency_s or 0.0,
        }
    finally:
        server.stop()


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--notice", type=float, default=30.0, help="the spot notice's lead, seconds (AWS: 120)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sg-window-"))
    try:
        stop = one("stop", args.notice, tmp / "stop")
        use = one("use-window", args.notice, tmp / "use")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, r in (("stop", stop), ("use-window", use)):
        print(
            f"{name:>10}: lead {r['lead_s']:.1f}s, {r['kept']:.0f} steps (median {r['step_s']:.3f}s) kept after the "
            f"notice, idle {r['idle_s']:.1f}s, lost {r['lost']:.0f} steps, emergency save {r['save_s']:.2f}s"
        )
    predicted = use["save_s"] + window_reserve(use["save_s"])
    print(f"planner: idle per noticed preemption with use-window ~{predicted:.1f}s + detection (<= 1 s poll)")
    lead = f"{args.notice:.0f} s lead"
    emit(
        [
            row(
                f"paid time idle per AWS spot preemption, use-window ({lead})",
                round(use["idle_s"], 2),
                "s",
                baseline=round(stop["idle_s"], 2),
                baseline_label='deadline_policy="stop", same run',
                target="<= 10 s",
                passed=lambda v, _: v <= 10.0,
            ),
            row(
                f"steps lost per AWS spot preemption, use-window ({lead})",
                use["lost"],
                "steps",
                baseline=stop["lost"],
                baseline_label='deadline_policy="stop", same run',
                target="0",
                passed=lambda v, _: v == 0,
            ),
        ],
        args.json,
    )


if __name__ == "__main__":
    main()
