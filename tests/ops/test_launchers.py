"""`spotguard run -- <launcher> ...` with real launchers on CPU: a stop reaches every rank, each commits the
emergency checkpoint, nothing of the job outlives `spotguard run`, and the restart resumes.

What the launchers do on their own: torchrun passes SIGTERM/SIGINT on to its ranks, each in a session of
its own, and exits 1 whatever they exited with; `accelerate launch --cpu` (one process, also what it runs
on one GPU) dies of SIGTERM at once and leaves its trainer running; `accelerate launch --multi_gpu`
runs torchrun inside itself. `deepspeed` on one node dies the same way and leaves its per-node launcher.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from spotguard import EXIT_PREEMPTED
from tests.helpers import (
    EXAMPLE_DDP,
    REPO,
    WAIT_S,
    WORKERS,
    ddp_example_cmd,
    free_port,
    last_step,
    read_losses,
    run,
    subprocess_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no"]
ACCELERATE += ["--dynamo_backend", "no"]
SLOW = ("--step-sleep", "0.05")
EXAMPLES = REPO / "examples"


def supervised(storage: Path, *child: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "spotguard", "run", "-v", "--storage", str(storage), "--backoff", "0.05"] + [
        "--max-restarts",
        str(restarts),
        "--",
        *child,
    ]


class Supervised:
    """`spotguard run` as a process of its own, with every process it ever had below it remembered
    (torchrun's ranks leave its tree once torchrun is gone), to check that none outlives it."""

    def __init__(self, cmd: list[str], cwd: Path, **env: str) -> None:
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd, env=subprocess_env(**env), stdout=self.out, stderr=self.err, cwd=cwd, start_new_session=True
        )
        self.seen: dict[int, psutil.Process] = {}

    def below(self) -> list[psutil.Process]:
        """The supervisor's processes now (and remembered)."""
        try:
            now = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            now = []
        for p in now:
            self.seen.setdefault(p.pid, p)
        return now

    def until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            self.below()
            assert self.proc.poll() is None, f"ended before {what}:\n{self.text()[1][-4000:]}"
            assert time.monotonic() < deadline, f"no {what} in {WAIT_S:.0f}s:\n{self.text()[1][-4000:]}"
            time.sleep(0.01)
        self.below()

    def finish(self) -> subprocess.CompletedProcess[str]:
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {WAIT_S:.0f}s:\n{self.text()[1][-4000:]}") from None
        out, err = self.text()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def survivors(self) -> list[str]:
        """The remembered processes still running (a zombie is not), by command line."""
        alive = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(p.cmdline()[:4]))
            except psutil.Error:
                pass  # gone while asked
        return alive

    def __enter__(self) -> Supervised:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_everything()  # whatever the test found: a failed one leaves nothing running either
        self.out.close()
        self.err.close()

    def kill_everything(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def text(self) -> tuple[str, str]:
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        return texts[0], texts[1]


def committed(storage: Path, step: int) -> bool:
    return (storage / f"step-{step:08d}" / "manifest.json").exists()


def test_a_process_the_job_left_in_a_session_of_its_own_is_stopped_before_a_restart(tmp_path):
    """A crashed job's child that outlives it (here in a session of its own, as torchrun starts its ranks)
    gets SIGTERM before the attempt counts as over: a restart never runs beside it (it ran on before)."""
    pid_file = tmp_path / "pid"
    script = (
        "import subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "sys.exit(3)\n"
    )
    done = run(supervised(tmp_path / "ckpt", sys.executable, "-c", script), env=subprocess_env(), cwd=tmp_path)
    pid = int(pid_file.read_text())
    assert done.returncode == 2 and "crashed with exit code 3" in done.stderr, done.stderr
    assert f"left 1 process(es) running: {pid} (sleep 60); sent SIGTERM to {pid}" in done.stderr, done.stderr
    try:
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not reaped by its new parent yet
    except psutil.NoSuchProcess:
        pass


def test_a_leftover_already_told_to_stop_is_not_signalled_twice_by_a_stop_that_follows(tmp_path):
    """A crashed launcher's leftover got SIGTERM and is writing its checkpoint when `spotguard run` is
    stopped too: that stop must not reach it a second time, which a Guard takes for "stop now"."""
    got, ready = tmp_path / "signals.txt", tmp_path / "ready"
    rank = (
        "import signal, sys, time\n"
        f"def record(signum, frame):\n    open({str(got)!r}, 'a').write('TERM\\n')\n"
        "signal.signal(signal.SIGTERM, record)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "deadline = time.monotonic() + 60\n"
        f"while time.monotonic() < deadline and not open({str(got)!r}, 'a+').tell():\n    time.sleep(0.01)\n"
        "time.sleep(3)\n"  # the emergency checkpoint
        "sys.exit(75)\n"
    )
    launcher = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
        f"while not os.path.exists({str(ready)!r}):\n    time.sleep(0.01)\n"
        "sys.exit(3)\n"
    )
    with Supervised(supervised(tmp_path / "ckpt", sys.executable, "-c", launcher), tmp_path) as job:
        job.until(lambda: got.exists() and got.read_text() == "TERM\n", "the leftover's SIGTERM")
        job.proc.send_signal(signal.SIGTERM)
        done = job.finish()
        assert job.survivors() == []
    assert "SIGTERM received: forwarding it to the job" in done.stderr, done.stderr
    assert got.read_text() == "TERM\n", done.stderr  # once


def test_a_hung_job_under_a_launcher_has_its_ranks_stacks_dumped_and_every_process_killed(tmp_path):
    """A hang under a launcher: the rank (here in a session of its own, as under torchrun) is the one
    stuck, so its stacks are dumped too, and it is killed with the launcher (before: only the launcher
    got SIGUSR2, died of it, and the rank hung on forever)."""
    pid_file = tmp_path / "pid"
    rank = (
        "import faulthandler, signal, time\n"  # what a Guard registers under `spotguard run`
        "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
        "def stuck_in_a_collective():\n    time.sleep(120)\n"
        "stuck_in_a_collective()\n"
    )
    launcher = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    cmd = supervised(tmp_path / "ckpt", sys.executable, "-c", launcher)
    cmd[cmd.index("--") : cmd.index("--")] = ["--startup-timeout", "3"]
    done = run(cmd, env=subprocess_env(), cwd=tmp_path)
    assert done.returncode == 2 and "the job hung" in done.stderr, done.stderr
    assert "in stuck_in_a_collective" in done.stderr, done.stderr  # the rank's stack, from its faulthandler
    try:
        assert psutil.Process(int(pid_file.read_text())).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


def test_torchrun_ranks_left_by_a_dead_launcher_checkpoint_before_the_restart_and_a_stop_reaches_them(tmp_path):
    """torchrun killed (OOM killer, a crash): its ranks, in sessions of their own, are stopped with a
    checkpoint before the restart instead of training on beside the new ones; the restart resumes from
    it; a SIGINT to `spotguard run` then stops the new ranks with a checkpoint: exit 75, nothing left."""
    storage, losses = tmp_path / "ckpt", tmp_path / "losses-0.jsonl"
    child = ddp_example_cmd(2, storage, "--steps", "400", "--every-steps", "0", *SLOW, "--losses", "")
    child[-1] = str(tmp_path / "losses-{rank}.jsonl")
    with Supervised(supervised(storage, *child, restarts=1), tmp_path) as job:
        job.until(lambda: (last_step(losses) or 0) >= 3, "a third step")
        (launcher,) = psutil.Process(job.proc.pid).children()
        launcher.kill()
        job.until(lambda: "resuming at step" in job.text()[0], "a resume")
        first = int(re.findall(r"resuming at step (\d+)", job.text()[0])[0])
        job.until(lambda: (last_step(losses) or 0) >= first + 3, "three steps after the resume")
        job.proc.send_signal(signal.SIGINT)
        done = job.finish()
        assert job.survivors() == []
    out, err = done.stdout, done.stderr
    assert "left 2 process(es) running" in err and "sent SIGTERM to" in err, err[-4000:]
    assert f"all 2 ranks stopped at step {first}" in out, out  # the dead launcher's ranks, on our SIGTERM
    assert f"newest checkpoint: step {first} (emergency)" in err and err.count("starting: ") == 2, err[-4000:]
    assert done.returncode == EXIT_PREEMPTED, err[-4000:]  # torchrun itself exits 1
    second = int(re.findall(r"all 2 ranks stopped at step (\d+)", out)[-1])
    assert second > first and committed(storage, first) and committed(storage, second)


def accelerate_launch(*how: str) -> list[str]:
    return [*ACCELERATE, *how, "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]


def test_accelerate_launch_in_one_process_leaves_no_trainer_behind_and_the_restart_resumes(tmp_path):
    """`accelerate launch --cpu` (one process, as on one GPU) dies of the SIGTERM at once (143); its
    trainer (examples/accelerate_train.py, AcceleratorGuard) must get the SIGTERM all the same (it trained
    on), and its exit 75, which no launcher reports, must reach `spotguard run` (the heartbeat flag):
    exit 75, a checkpoint of the stop step, no process left; `spotguard run` again resumes there."""
    storage, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    script = [str(EXAMPLES / "accelerate_train.py"), "--steps", "80", "--every-steps", "0", "--interval", "0.2"]
    cmd = supervised(storage, *accelerate_launch("--cpu", "--num_processes", "1"), *script, "--losses", str(losses))
    with Supervised([*cmd, *SLOW, "--quiet"], tmp_path) as job:
        job.until(lambda: (last_step(losses) or 0) >= 3, "step 3")
        job.proc.send_signal(signal.SIGTERM)
        done = job.finish()
        assert job.survivors() == []
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-4000:]
    assert "the job's launcher exited with code 143 and left 1 process(es) running" in done.stderr
    (stop,) = map(int, re.findall(r"stopped at step (\d+)", done.stdout))
    assert committed(storage, stop) and last_step(losses) == stop < 80

    again = run([*cmd, "--quiet"], env=subprocess_env(), cwd=tmp_path)
    assert again.returncode == 0 and "finished 80 steps" in again.stdout, again.stderr[-4000:]
    assert [s for s, _ in read_losses(losses)] == list(range(1, 81)), stop  # resumed after the stop step


def test_accelerate_launch_with_two_processes_stops_both_with_a_checkpoint(tmp_path):
    """`accelerate launch --multi_gpu` on CPU (gloo) runs torchrun inside itself, which passes the SIGINT on
    to both ranks and exits 1 (this case passed before; a launcher that died: the torchrun test): exit 75,
    one checkpoint of the step both stopped at, no process left."""
    storage = tmp_path / "ckpt"
    worker = [str(WORKERS / "accelerate_guard.py"), str(tmp_path), "--steps", "400", *SLOW]
    cmd = supervised(storage, *accelerate_launch("--multi_gpu", "--num_processes", "2"), *worker)
    with Supervised(cmd, tmp_path) as job:
        job.until(lambda: all((last_step(tmp_path / f"losses-{r}.jsonl") or 0) >= 3 for r in (0, 1)), "step 3")
        job.proc.send_signal(signal.SIGINT)
        done = job.finish()
        assert job.survivors() == []
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-4000:]
    stops = re.findall(r"stopped at step (\d+)", done.stdout)
    assert len(stops) == 2 and len(set(stops)) == 1, done.stdout  # both ranks, at the same step
    assert committed(storage, int(stops[0]))


def test_deepspeed_launcher_left_by_its_runner_passes_the_stop_to_the_ranks(tmp_path):
    """`deepspeed` on one node runs its per-node launcher and dies of the SIGTERM at once (143); that
    launcher, left running with both ranks, must get the SIGTERM and pass it on (it did not: all three
    trained on). Exit 75, a checkpoint of the stop step, no process left."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")
    storage, losses = tmp_path / "ckpt", tmp_path / "losses-0.jsonl"
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank", "--num_gpus", "2"]
    runner += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    child = ddp_example_cmd(2, storage, "--steps", "400", "--every-steps", "0", *SLOW, "--losses", "")
    script = child[child.index(str(EXAMPLE_DDP)) :]
    script[-1] = str(tmp_path / "losses-{rank}.jsonl")
    with Supervised(supervised(storage, *runner, *script), tmp_path, DS_ACCELERATOR="cpu") as job:
        job.until(lambda: (last_step(losses) or 0) >= 3, "a third step")
        job.proc.send_signal(signal.SIGTERM)
        done = job.finish()
        assert job.survivors() == []
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-4000:]
    assert re.search(r"left \d+ process\(es\) running: \d+ \([^)]*deepspeed.launcher.launch", done.stderr)
    (stop,) = re.findall(r"all 2 ranks stopped at step (\d+)", done.stdout)
    assert committed(storage, int(stop))


def test_workers_of_a_launcher_that_exits_1_are_not_left_running_when_spotguard_run_gives_up(tmp_path):
    """The issue's case: a launcher starts three workers in its own process group and exits 1, twice
    (one restart). Before, `spotguard run` gave up with every worker still running, re-parented to
    PID 1; now each attempt's workers are stopped (SIGTERM, then SIGKILL for the one that ignores it)."""
    pids = tmp_path / "pids"
    worker = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n"
    launcher = (
        "import subprocess, sys, time\n"
        f"ws = [subprocess.Popen(['sleep', '120']) for _ in range(2)]\n"
        f"ws.append(subprocess.Popen([sys.executable, '-c', {worker!r}]))\n"
        f"open({str(pids)!r}, 'a').write(''.join(f'{{w.pid}}\\n' for w in ws))\n"
        "time.sleep(0.5)\n"  # the workers are running (and the last one ignores SIGTERM)
        "sys.exit(1)\n"
    )
    cmd = supervised(tmp_path / "ckpt", sys.executable, "-c", launcher, restarts=1)
    with Supervised(cmd[:4] + ["--grace", "1"] + cmd[4:], tmp_path) as job:
        done = job.finish()
        started = [int(p) for p in pids.read_text().split()]
        alive = []
        for pid in started:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {p.cmdline()} (parent {p.ppid()})")
            except psutil.NoSuchProcess:
                pass
            else:
                job.seen.setdefault(pid, p)  # killed by __exit__ whatever happens
    assert done.returncode == 2 and "crashed with exit code 1 and the restart budget is used up" in done.stderr
    assert len(started) == 6 and alive == [], done.stderr
    assert done.stderr.count("left 3 process(es) running") == 2, done.stderr
