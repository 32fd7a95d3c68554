"""`spotguard rehearse` on examples/train.py: what preemptions cost, measured, beside the planner.

Three rehearsals, each a real job through real preemptions (the mock AWS metadata service over
HTTP, a fresh local folder per machine, AWS's 120 s lead):

1. exactness: 5 preemptions of a 90-step run (one within 3 s of a restart, one during a save in
   flight, one during an evaluation), with ``--reference``: steps lost per noticed preemption, and
   whether the final checkpoint is bit for bit the uninterrupted run's; the same for the Hugging
   Face Trainer example (one notice while it imports);
2. goodput: 5 preemptions at a mean of 40 s of training between them (slow steps, so the
   restart is small beside the MTBF, as on a real fleet): measured goodput against the planner's
   prediction for the same measured costs (``planner.goodput``), and the idle window per preemption;
3. overhead: a CPU-bound run through 2 preemptions: the CPU time of rehearse itself (mock server,
   monitoring) against the job's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rows import emit, parser, row  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, "examples/train.py", "--quiet"]


def rehearse(tmp: Path, name: str, *args: str, command: list[str]) -> dict:
    storage = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "spotguard", "rehearse", "--json", "--fresh-local", "--storage", str(storage), *args]
        + ["--", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"rehearse {name} printed no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    doc = json.loads(lines[-1])
    doc["exit_code"] = proc.returncode
    return doc


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rehearse-") as tmp:
        t = Path(tmp)
        exact = rehearse(
            t,
            "exact",
            *("-n", "5", "--mtbf", "0.5", "--seed", "0", "--reference", "--replacement-delay", "0.5"),
            *("--after-restart", "1", "--during-save", "1", "--during-eval", "1"),
            command=[
                *TRAIN,
                *("--steps", "90", "--every-steps", "20", "--eval-every", "15"),
                *("--interval", "0.2", "--step-sleep", "0.03"),
            ],
        )
        pre = exact["preemptions"]
        where = ", ".join(str(p["landed"]) for p in pre)
        lost = max((p["steps_lost"] or 0) + (p["steps_replayed"] or 0) for p in pre) if pre else -1
        rows.append(
            row(
                f"train.py, {len(pre)} preemptions ({where}): steps lost per noticed preemption (worst)",
                lost,
                "steps",
                target="0, all committed",
                passed=lambda v, _: v == 0 and exact["all_committed"] and len(pre) == 5,
            )
        )
        ref = exact["reference"] or {}
        rows.append(
            row(
                "train.py, 5 preemptions vs uninterrupted: final checkpoint bit for bit",
                1.0 if ref.get("exact") else 0.0,
                "(1 = exact)",
                target="exact",
                passed=lambda v, _: v == 1.0,
            )
        )
        hf = rehearse(
            t,
            "hf",
            *("-n", "5", "--mtbf", "1", "--seed", "4", "--after-restart", "1", "--reference"),
            *("--replacement-delay", "0.5"),
            command=[
                sys.executable,
                *("examples/hf_trainer.py", "--quiet", "--steps", "40", "--every-steps", "20", "--interval", "0.2"),
                *("--step-sleep", "0.05", "--output-dir", "{local}/hf-output"),
            ],
        )
        hpre = hf["preemptions"]
        hlost = max((p["steps_lost"] or 0) + (p["steps_replayed"] or 0) for p in hpre) if hpre else -1
        rows.append(
            row(
                f"hf_trainer.py, {len(hpre)} preemptions: steps lost per noticed preemption (worst); exact",
                hlost,
                "steps",
                target="0, all committed, exact",
                passed=lambda v, _: (
                    v == 0 and hf["all_committed"] and len(hpre) == 5 and bool((hf["reference"] or {}).get("exact"))
                ),
            )
        )
        good = rehearse(
            t,
            "goodput",
            *("-n", "5", "--mtbf", "40", "--seed", "7", "--replacement-delay", "1"),
            command=[*TRAIN, "--steps", "1400", "--every-steps", "100", "--step-sleep", "0.2"],
        )
        g, pg = good["goodput"], good["planner_goodput"]
        rows.append(
            row(
                f"goodput, train.py through {len(good['preemptions'])} preemptions (measured)",
                100 * g,
                "%",
                baseline=100 * pg,
                baseline_label="planner, same measured costs and realised MTBF",
                target="within 2 pp",
                passed=lambda v, _: abs(v - 100 * pg) <= 2.0,
            )
        )
        idle = [p["idle_s"] for p in good["preemptions"] if p["idle_s"] is not None]
        teardown = [p["teardown_s"] for p in good["preemptions"] if p["teardown_s"] is not None]
        if idle:
            rows.append(
                row(
                    "idle window per preemption (last commit -> deadline), mean",
                    sum(idle) / len(idle),
                    "s",
                    baseline=120.0,
                    baseline_label="AWS notice lead",
                )
            )
        if teardown:
            rows.append(row("teardown after the last commit (process exit), mean", sum(teardown) / len(teardown), "s"))
        restart = good["costs"]["restart_s"]
        if restart is not None:
            rows.append(row("restart: job gone -> first step on the next machine, mean", restart, "s"))
        cpu = rehearse(
            t,
            "overhead",
            *("-n", "2", "--mtbf", "15", "--seed", "1"),
            command=[*TRAIN, "--steps", "1200", "--every-steps", "200"],
        )
        rows.append(
            row(
                "rehearse's own CPU (mock server, monitoring), 2 preemptions",
                cpu["cpu_self_s"],
                "s",
                baseline=cpu["cpu_job_s"],
                baseline_label="the job's CPU (all its processes)",
                target="ratio < 0.01",
                passed=lambda v, ratio: ratio is not None and ratio < 0.01,
            )
        )
    emit(rows, args.json)


if __name__ == "__main__":
    main()
