"""The whole story in under a minute, on a laptop: train, get a (simulated) cloud preemption, resume exactly.

1. start spotguard's mock metadata server for a cloud (AWS by default: ``--cloud gcp|azure``);
2. train examples/train.py without interruption (the reference), in the background;
3. train again, watching the mock's metadata; ``spotguard simulate-preemption`` posts the cloud's
   spot notice mid-run; the job writes an emergency checkpoint and exits 75;
4. start the job again: it resumes from that checkpoint and finishes;
5. compare: every per-step loss and every final parameter must equal the reference bit for bit
   (exit 1 otherwise).

Everything lives under ./demo-run; every process started here is stopped before the end.

    python examples/demo.py [--cloud aws|gcp|azure] [--steps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from spotguard import EXIT_PREEMPTED  # noqa: E402
from spotguard.checkpoint import scan  # noqa: E402
from spotguard.ops.mockmeta import control, endpoint_env  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402

TRAIN = REPO / "examples" / "train.py"


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def read_losses(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r]


class Processes:
    """Every child this demo starts, so that each one is stopped whatever happens."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(cmd, env=env, text=True, **kwargs)  # type: ignore[call-overload]
        self.children.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cloud", choices=("aws", "gcp", "azure"), default="aws")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--notice-at", type=int, default=45, help="step at which the notice is simulated")
    p.add_argument("--dir", default="demo-run")
    args = p.parse_args()

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    base_env["PYTHONUNBUFFERED"] = "1"
    common = ["--steps", str(args.steps), "--every-steps", "50", "--quiet"]
    procs = Processes()
    t0 = time.monotonic()
    try:
        mock = procs.start(
            [sys.executable, "-m", "spotguard", "mock-metadata", "--cloud", args.cloud, "--port", "0"],
            base_env,
            stdout=subprocess.PIPE,
        )
        assert mock.stdout is not None
        banner = mock.stdout.readline().strip()
        if " on http://" not in banner:
            say(f"the mock metadata server did not start: {banner!r}")
            return 1
        url = banner.split(" on ")[1]
        say(f"mock {args.cloud} metadata server: {url}")
        env = dict(base_env, **endpoint_env(args.cloud, url))
        say("   " + " ".join(f"{k}={v}" for k, v in endpoint_env(args.cloud, url).items()))

        say(f"reference: {args.steps} uninterrupted steps (in the background)")
        ref_losses, ref_final = work / "reference-losses.jsonl", work / "reference-final.pt"
        reference = procs.start(
            [
                sys.executable,
                str(TRAIN),
                "--storage",
                str(work / "reference-ckpt"),
                *common,
                "--providers",
                "signal",
                "--losses",
                str(ref_losses),
                "--final",
                str(ref_final),
            ],
            base_env,
            stdout=subprocess.DEVNULL,
        )

        storage, losses, final = work / "checkpoints", work / "losses.jsonl", work / "final.pt"
        job = [
            sys.executable,
            str(TRAIN),
            "--storage",
            str(storage),
            *common,
            "--providers",
            args.cloud,
            "--losses",
            str(losses),
        ]
        say(f"run 1: training with --providers {args.cloud} (polling every 1 s)")
        first = procs.start([*job, "--step-sleep", "0.03"], env, stdout=subprocess.PIPE)
        while not read_losses(losses) or read_losses(losses)[-1][0] < args.notice_at:
            if first.poll() is not None:
                say(f"run 1 ended before the notice (exit {first.returncode})")
                return 1
            time.sleep(0.01)
        say(f"step {read_losses(losses)[-1][0]}: $ spotguard simulate-preemption --cloud {args.cloud} --endpoint {url}")
        sim = subprocess.run(
            [sys.executable, "-m", "spotguard", "simulate-preemption", "--cloud", args.cloud, "--endpoint", url],
            env=base_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        say("   " + (sim.stdout.strip() or sim.stderr.strip()))
        out, _ = first.communicate(timeout=120)
        for line in out.splitlines():
            say("   " + line)
        if first.returncode != EXIT_PREEMPTED:
            say(f"run 1 exited {first.returncode}, expected {EXIT_PREEMPTED}")
            return 1
        for info in scan(open_storage(str(storage))):
            m = info.manifest
            say(f"   checkpoint {info.name}: {info.status}, reason {m.reason if m else '?'}")
        if args.cloud == "azure":
            say(f"   Azure eviction acknowledged (StartRequests): {control(url, 'state')['acks']}")
        control(url, "clear")  # the next machine starts with no notice

        say("run 2: the same command on the 'replacement machine'")
        second = subprocess.run(job + ["--final", str(final)], env=env, capture_output=True, text=True, timeout=180)
        for line in second.stdout.splitlines():
            say("   " + line)
        if second.returncode != 0 or reference.wait(timeout=180) != 0:
            say(f"run 2 exited {second.returncode}, reference exited {reference.returncode}\n{second.stderr}")
            return 1

        ref = dict(read_losses(ref_losses))
        got = read_losses(losses)
        bad = [step for step, loss in got if ref.get(step) != loss]
        steps_seen = sorted({step for step, _ in got})
        a, b = torch.load(final, weights_only=True), torch.load(ref_final, weights_only=True)
        same_params = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        replayed = len(got) - len(steps_seen)
        say(
            f"compared {len(got)} logged losses ({replayed} replayed after the resume) and "
            f"{sum(v.numel() for v in a.values())} parameters with the reference"
        )
        if bad or steps_seen != sorted(ref) or not same_params:
            say(f"MISMATCH: losses differ at steps {bad[:10]}, parameters equal: {same_params}")
            return 1
        say(
            f"resumed losses and final parameters match the uninterrupted run bit for bit "
            f"({time.monotonic() - t0:.0f}s)"
        )
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
