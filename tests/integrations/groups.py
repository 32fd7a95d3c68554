"""Running a trainer example as a process group, stopping one rank with a notice, comparing with a reference.

The story of tests/integrations/runs.py, with torchrun: an uninterrupted 2-rank reference run, then a
run where only rank 1 gets a notice (a per-rank notice file), which must stop both ranks after the
same step with one committed emergency checkpoint, then the resume to the end, whose every logged
loss and final weights equal the reference bit for bit. Two layouts: 2 ranks on one "node", and 2
"nodes" x 1 rank (two torchrun agents, c10d rendezvous on 127.0.0.1) that share nothing but the
checkpoint storage: each has its own temp folder (``TMPDIR``) and trainer output folder.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spotguard import EXIT_PREEMPTED
from spotguard.checkpoint import scan
from spotguard.storage import open_storage

from ..forked import behind, launched
from ..helpers import REPO, assert_same_run, free_port, last_step, read_losses, run, stop_when, subprocess_env

SLOW = ("--step-sleep", "0.05")  # a notice sent after step N lands before step N + 2


def torchrun_args(nnodes: int, nproc: int, port: int, job: str) -> list[str]:
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        *rdzv,
        "--local-addr",
        "127.0.0.1",
    ]


def accelerate_args(nnodes: int, nproc: int, port: int, node: int, *mode: str) -> list[str]:
    """``accelerate launch`` of ``nproc`` processes on machine ``node`` of ``nnodes`` (``mode`` default
    ``--multi_gpu``, its torchrun launcher; the scripts ask for the CPU themselves, and ``--cpu`` would
    run one process; ``--use_fsdp ...`` runs the same launcher)."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *(mode or ("--multi_gpu",)),
        "--num_processes",
        str(nnodes * nproc),
        "--num_machines",
        str(nnodes),
        "--machine_rank",
        str(node),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--monitor_interval",
        "0.2",
    ]


@contextlib.contextmanager
def forked_ranks(*scripts: str) -> Iterator[None]:
    """While inside, every rank the launchers start (torchrun's, ``accelerate launch``'s) is forked from
    one server that imported the examples ``scripts``' imports (torch, the trainer library: 3-5 CPU
    seconds a rank), not a Python process of its own; so are the launchers that ``tests.helpers.run``
    starts (``tests.forked.LAUNCHERS``), which then run their own code as they do in a process of their own."""
    with behind(*(REPO / "examples" / s for s in scripts)):
        yield


class Job:
    """One training job of ``script`` on ``nodes`` launcher agents x ``nproc`` ranks, in ``run_dir``.

    ``launcher``: "torchrun" or "accelerate" (``accelerate launch``). ``local_args(node)`` gives the
    arguments naming a node's own local folders (e.g. the Trainer's ``--output-dir``); every node
    gets its own ``TMPDIR`` (spotguard's resume copy lives there). ``launcher_args``: the mode of
    ``accelerate launch`` and its options, instead of ``--multi_gpu`` (e.g. ``--use_fsdp ...``).
    """

    def __init__(
        self,
        script: str,
        run_dir: Path,
        args: tuple[str, ...],
        *,
        nodes: int = 1,
        nproc: int = 2,
        local_args: Callable[[Path], tuple[str, ...]] = lambda node: (),
        launcher: str = "torchrun",
        launcher_args: tuple[str, ...] = (),
    ) -> None:
        self.script, self.run_dir, self.args, self.launcher = script, run_dir, args, launcher
        self.launcher_args = launcher_args
        self.nodes, self.nproc, self.local_args = nodes, nproc, local_args
        self.losses = run_dir / "losses.jsonl"
        self.final = run_dir / "final.pt"
        self.notices = run_dir / "notices"
        self.notices.mkdir(parents=True, exist_ok=True)
        self._rng = random.Random()
        self.resumed: list[subprocess.CompletedProcess[str]] = []  # the last ``finish``'s processes

    def node_dir(self, node: int) -> Path:
        path = self.run_dir / f"node{node}"
        (path / "tmp").mkdir(parents=True, exist_ok=True)
        return path

    def commands(self, *extra: str, quiet: bool = True) -> list[tuple[list[str], dict[str, str]]]:
        port, job = free_port(), f"job-{self._rng.randrange(1 << 30)}"
        out = []
        for node in range(self.nodes):
            local = self.node_dir(node)
            launch = (
                accelerate_args(self.nodes, self.nproc, port, node, *self.launcher_args)
                if self.launcher == "accelerate"
                else torchrun_args(self.nodes, self.nproc, port, job)
            )
            cmd = [
                *launch,
                *launched(REPO / "examples" / self.script),
                "--storage",
                str(self.run_dir / "ckpt"),
                "--losses",
                str(self.losses),
                *(("--quiet",) if quiet else ()),  # not quiet: spotguard's INFO lines (what each node fetched)
                *self.args,
                *self.local_args(local),
                *extra,
            ]
            env = subprocess_env(TMPDIR=str(local / "tmp"), SPOTGUARD_NOTICE_FILE=str(self.notices / "notice-{rank}"))
            out.append((cmd, env))
        return out

    def run(self, *extra: str, quiet: bool = True) -> list[subprocess.CompletedProcess[str]]:
        """Every node to its end."""
        cmds = self.commands(*extra, quiet=quiet)
        with ThreadPoolExecutor(len(cmds)) as pool:
            return list(pool.map(lambda c: run(c[0], env=c[1], cwd=self.run_dir), cmds))

    def stop_rank_at(self, rank: int, at: int, *extra: str) -> list[subprocess.CompletedProcess[str]]:
        """Run with a notice file for ``rank`` only, written once rank 0 logged step ``at``."""
        return self.stop_rank_when(rank, lambda: (last_step(self.losses) or 0) >= at, *extra)

    def stop_rank_when(
        self, rank: int, ready: Callable[[], bool], *extra: str
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run with a notice file for ``rank`` only, written once ``ready()`` holds."""
        (self.notices / f"notice-{rank}").unlink(missing_ok=True)

        def notify(proc: object) -> None:
            (self.notices / f"notice-{rank}").write_text(json.dumps({"deadline_in": 120}))

        cmds = self.commands(*SLOW, *extra)
        watched, others = cmds[0], cmds[1:]
        with ThreadPoolExecutor(max(1, len(others))) as pool:
            rest = [pool.submit(run, c, env=e, cwd=self.run_dir) for c, e in others]
            first = stop_when(watched[0], ready, notify, env=watched[1], cwd=self.run_dir)
            done = [first, *(f.result() for f in rest)]
        (self.notices / f"notice-{rank}").unlink(missing_ok=True)
        return done


def exit_codes(proc: subprocess.CompletedProcess[str]) -> list[int]:
    """The ranks' own exit codes from torchrun's failure summary (torchrun itself exits 1)."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]


def assert_all_stopped(job: Job, procs: list[subprocess.CompletedProcess[str]], at: int) -> tuple[int, set[str]]:
    """Every rank exited 75 (none killed by torchrun), and the stop step is committed as an emergency
    checkpoint written by all ranks; returns that step and the files of its checkpoint."""
    stopped = read_losses(job.losses)[-1][0]
    for proc in procs:
        assert proc.returncode != 0, proc.stderr[-3000:]
        # torchrun SIGTERMs the ranks still exiting once one rank has exited non-zero (-15): every
        # rank must have stopped at the same step, and one at least be seen exiting 75.
        codes = exit_codes(proc)
        assert EXIT_PREEMPTED in codes and set(codes) <= {EXIT_PREEMPTED, -15}, (codes, proc.stderr[-4000:])
    said = re.findall(r"stopped at step (\d+)", "".join(p.stdout for p in procs))
    assert said == [str(stopped)] * job.nodes * job.nproc, (said, stopped)
    assert at <= stopped, (at, stopped)
    infos = {i.step: i for i in scan(open_storage(str(job.run_dir / "ckpt")))}
    info = infos[stopped]
    assert info.complete and info.manifest is not None, info
    again = any("already checkpointed" in p.stderr for p in procs)
    assert info.manifest.reason in ({"emergency", "periodic"} if again else {"emergency"}), info.manifest
    assert info.manifest.world_size == job.nodes * job.nproc
    return stopped, {f.name for f in info.manifest.files}


def reference(script: str, run_dir: Path, args: tuple[str, ...], **job_kwargs) -> tuple[list, Path]:
    job = Job(script, run_dir, args, **job_kwargs)
    procs = job.run("--final", str(job.final))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return read_losses(job.losses), job.final


def stop_one_rank_then_finish(
    job: Job, steps: int, ref, rng: random.Random, quiet: bool = True
) -> tuple[int, set[str]]:
    """A notice on rank 1 only at a random step: all ranks stop after the same step and commit; the
    resume finishes exactly like the reference (``finish``). Returns the stop step and its checkpoint's files."""
    at = rng.randint(3, steps - 6)
    stopped = assert_all_stopped(job, job.stop_rank_at(1, at), at)
    finish(job, ref, quiet)
    return stopped


def finish(job: Job, ref, quiet: bool = True) -> list[subprocess.CompletedProcess[str]]:
    """The resume, uninterrupted to the end: every logged loss and the final weights equal ``ref``.
    Returns its processes, one per node, also kept as ``job.resumed`` (``quiet=False``: with
    spotguard's INFO lines, e.g. what each node fetched: ``fetched``)."""
    last = job.run("--final", str(job.final), quiet=quiet)
    for proc in last:
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_run(job.losses, job.final, ref)
    job.resumed = last
    return last


FETCHED = re.compile(
    r"the node of rank\(s\) ([\d,]+) fetched (\d+) of (\d+) files of (\S+) \((\d+) of (\d+) bytes\)"
    r"(?:; every file: [^;\n]*)?(?:; left to other nodes' ranks: ([^\n]*))?"
)


def fetched(procs: list[subprocess.CompletedProcess[str]]) -> dict[int, dict]:
    """What each node fetched at the resume, from spotguard's INFO line (runs with ``quiet=False``):
    by rank (each node of one rank), the checkpoint, the bytes fetched and in all, the names left out."""
    found = {}
    for proc in procs:
        for m in FETCHED.finditer(proc.stderr):
            ranks, _, _, name, got, total, left = m.groups()
            for rank in map(int, ranks.split(",")):
                assert rank not in found, f"rank {rank}'s node fetched twice: {proc.stderr[-3000:]}"
                found[rank] = {
                    "step": name,
                    "bytes": int(got),
                    "total": int(total),
                    "left": set((left or "").split(", ")) - {""},
                }
    return found


def assert_each_node_left_out_the_others(procs, stopped: int, own: Callable[[int], set[str]]) -> dict[int, dict]:
    """Two nodes of one rank each resumed checkpoint ``stopped``: each node's folder held all of it but
    the other rank's own files ``own(rank)`` (the shared files and its own), and fetched fewer bytes."""
    nodes = fetched(procs)
    assert sorted(nodes) == [0, 1], [p.stderr[-3000:] for p in procs]
    for rank, node in nodes.items():
        assert node["step"] == f"step-{stopped:08d}", node
        assert node["left"] == own(1 - rank), (rank, node)
        assert 0 < node["bytes"] < node["total"], node
    return nodes
