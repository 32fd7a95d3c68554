"""What many tests share: child process environments, free ports, launching examples and workers (plain or
under torchrun), stopping them at a chosen moment, reading their JSON lines, comparing their states."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train.py"
EXAMPLE_DDP = REPO / "examples" / "train_ddp.py"
WORKERS = REPO / "tests" / "workers"  # scripts the tests run as processes (torchrun workers, drivers)
#: examples/train.py's run in the resume tests (tests/guard, tests/ops, tests/storage share its reference run):
#: ~38 batches per epoch, so 90 steps cover two epoch boundaries.
EXAMPLE_ARGS = ("--steps", "90", "--every-steps", "20", "--batch-size", "16")
#: examples/train_ddp.py's run in the distributed tests (tests/guard/test_distributed.py, test_multinode.py).
DDP_ARGS = ("--steps", "40", "--every-steps", "15")
#: SPOTGUARD_* variables children keep (the metadata endpoint tests point at a closed port or a mock).
KEEP_ENV = ("SPOTGUARD_AZURE_METADATA_ENDPOINT",)
#: How long a child may take to reach a moment or to finish: a loaded 2-core machine imports torch slowly.
WAIT_S = 240.0
_CLOSED: socket.socket | None = None


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this checkout first on the path, no stray notice config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") or k in KEEP_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def block_cloud_metadata() -> None:
    """Point every metadata endpoint variable at a bound, never-listening 127.0.0.1 port (refused at once)."""
    global _CLOSED
    if _CLOSED is None:
        _CLOSED = socket.socket()
        _CLOSED.bind(("127.0.0.1", 0))  # held for the session, never listen(): connections are refused
    port = _CLOSED.getsockname()[1]
    os.environ.update(
        {
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}",
            "GCE_METADATA_HOST": f"127.0.0.1:{port}",
            "GCE_METADATA_IP": f"127.0.0.1:{port}",
            "SPOTGUARD_AZURE_METADATA_ENDPOINT": f"http://127.0.0.1:{port}",
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now (for servers at ``port + local rank``)."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first + 1, first + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError(f"no {n} consecutive free ports")


# -- commands ---------------------------------------------------------------------------------------
def example_cmd(storage: str | Path, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--storage", str(storage), "--quiet", *args]


def torchrun(nproc: int, script: str | Path, *args: str) -> list[str]:
    """``nproc`` ranks of ``script`` on this machine (gloo, a free port on 127.0.0.1); forked from a
    ``tests.forked.behind`` server that imported ``script``, while one runs."""
    from tests.forked import launched

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *launched(script),
        *args,
    ]


def ddp_example_cmd(nproc: int, storage: str | Path, *args: str, script: Path = EXAMPLE_DDP) -> list[str]:
    """examples/train_ddp.py (or a worker taking its arguments) under torchrun, polling every 0.2 s."""
    return torchrun(nproc, script, "--storage", str(storage), "--quiet", "--interval", "0.2", *args)


# -- running processes ------------------------------------------------------------------------------
def _finish(proc: subprocess.Popen[bytes], out: Any, err: Any, timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for ``proc`` (its own session); past ``timeout`` kill the session and fail with its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # torchrun's workers are in its session: ranks waiting on each other go too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        else:
            timed_out = False
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    if timed_out:
        raise AssertionError(f"still running after {timeout:.0f}s: {proc.args}\n{texts[0][-3000:]}\n{texts[1][-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, texts[0], texts[1])


def _start(cmd: list[str], env: dict[str, str] | None, cwd: Path | None) -> tuple[subprocess.Popen[bytes], Any, Any]:
    from tests.forked import server_for

    server = server_for(cmd)
    if server is not None:  # the script's runs fork from a server that imported torch once (tests/forked.py)
        out, err = tempfile.NamedTemporaryFile(), tempfile.NamedTemporaryFile()  # noqa: SIM115
        forked = server.popen(cmd, env=env or subprocess_env(), cwd=cwd, out=out.name, err=err.name)
        return forked, out, err  # type: ignore[return-value]
    # Output goes to files, not pipes: a chatty child never blocks on a full pipe while the test polls.
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env or subprocess_env(), stdout=out, stderr=err, cwd=cwd, start_new_session=True)
    return proc, out, err


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = WAIT_S, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end (its whole session is killed past ``timeout``, and the test fails)."""
    return _finish(*_start(cmd, env, cwd), timeout)


def run_ranks(cmd: list[str], world: int = 2, timeout: float = WAIT_S) -> list[subprocess.CompletedProcess[str]]:
    """``world`` plain processes of ``cmd`` as one job (rank 0 hosts the TCP store; no torchrun agent)."""
    port = str(free_port())
    envs = [
        subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(world)
    ]
    started = [_start(cmd, env, None) for env in envs]
    return [_finish(*s, timeout) for s in started]


def run_group(
    cmd: list[str], world: int = 2, timeout: float = WAIT_S, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """``world`` ranks of ``cmd`` as torchrun runs them, less torchrun's own process (a Python start and
    ``import torch``, seconds each launch): the TCP store is held here, as torchrun's agent holds it
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client, so it outlives any rank), and a rank that
    fails ends the others (SIGTERM), as torchrun does. For workers whose launcher is not under test.
    ``env``: the ranks' environment before their rank variables (default ``subprocess_env()``)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    envs = [
        dict(
            env or subprocess_env(),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        for r in range(world)
    ]
    started = [_start(cmd, env, None) for env in envs]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _, _ in started) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p, _, _ in started):
                for p, _, _ in started:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGTERM)
                break
            time.sleep(0.02)
        return [_finish(*s, max(0.1, deadline - time.monotonic())) for s in started]
    finally:
        del store


def stop_when(
    cmd: list[str],
    ready: Callable[[], bool],
    act: Callable[[subprocess.Popen[bytes]], object],
    *,
    env: dict[str, str] | None = None,
    timeout: float = WAIT_S,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Start ``cmd``; once ``ready()`` holds call ``act(proc)`` (send a signal, a notice), then wait for the end.

    Fails if the process ends, or ``timeout`` passes, before the moment came.
    """
    proc, out, err = _start(cmd, env, cwd)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                done = _finish(proc, out, err, 1)
                raise AssertionError(
                    f"ended (exit {done.returncode}) or hung before the moment to act: {cmd}\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                )
            time.sleep(0.005)
        act(proc)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return _finish(proc, out, err, timeout)


def signal_to(sig: int) -> Callable[[subprocess.Popen[bytes]], None]:
    return lambda proc: proc.send_signal(sig)


def after_step(losses: Path, step: int) -> Callable[[], bool]:
    """True once the losses file has logged ``step``."""
    return lambda: (last_step(losses) or 0) >= step


def stopped_for_notice(proc: subprocess.CompletedProcess[str]) -> bool:
    """torchrun exits 1 when a worker exits non-zero; the workers' own code (75) is in its summary."""
    from spotguard import EXIT_PREEMPTED

    return proc.returncode != 0 and re.search(rf"exitcode\s*:\s*{EXIT_PREEMPTED}\b", proc.stderr) is not None


def run_example(
    storage: str | Path, *args: str, env: dict[str, str] | None = None, timeout: float = WAIT_S
) -> subprocess.CompletedProcess[str]:
    return run(example_cmd(storage, *args), env=env, timeout=timeout)


# -- reading what children write --------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON lines file that another process may still be appending to: a last line
    without its newline is still being written and is not read."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def read_losses(path: Path) -> list[tuple[int, float]]:
    """(step, loss) pairs in the order they were logged; losses are exact (float.hex)."""
    return [(rec["step"], float.fromhex(rec["loss"])) for rec in read_jsonl(path)]


def worker_results(out_dir: Path, ranks: int = 2) -> list[dict[str, Any]]:
    """What the ranks of a worker reported with ``tests.workers.results.emit``, rank by rank."""
    return [rec for rank in range(ranks) for rec in read_jsonl(out_dir / f"results-{rank}.jsonl")]


def last_step(path: Path) -> int | None:
    losses = read_losses(path)
    return losses[-1][0] if losses else None


# -- comparing ---------------------------------------------------------------------------------------
def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested state dicts equal exactly (tensors with torch.equal)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same_run(losses: Path, final: Path, reference: tuple[list[tuple[int, float]], Path]) -> None:
    """Every logged step (replays after a stop included) and the final state equal the uninterrupted run."""
    import torch

    ref_losses, ref_final = reference
    want = dict(ref_losses)
    by_step: dict[int, float] = {}
    for step, loss in read_losses(losses):
        assert loss == want[step], f"step {step}: {loss!r} != {want[step]!r}"
        by_step[step] = loss
    assert sorted(by_step.items()) == ref_losses
    assert_same(torch.load(final, weights_only=True), torch.load(ref_final, weights_only=True))


def chunked_sha256(data: bytes, chunk: int = 16 << 20) -> str:
    """What a spotguard/2 manifest records for a file: SHA-256 of its chunks' SHA-256 digests."""
    return chunked_digest(data, chunk, "sha256")


def chunked_digest(data: bytes, chunk: int = 16 << 20, alg: str = "blake3") -> str:
    """What a manifest records for a file, computed here from the definition (not spotguard's code):
    the hash of its chunks' hashes, all with ``alg``."""
    import blake3
    import xxhash

    new = {"sha256": hashlib.sha256, "blake3": blake3.blake3, "xxh3-128": xxhash.xxh3_128}[alg]
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    return new(b"".join(new(p).digest() for p in pieces)).hexdigest()


@contextlib.contextmanager
def azure_approvals_read_the_lease(storage: Any, work_dir: Path, monkeypatch: Any) -> Any:
    """The mock Azure IMDS over real HTTP (its endpoint in the environment) and an Azure provider that
    reads ``storage``'s writer lease whenever it approves a Preempt event (Azure may evict the machine
    as soon as it is approved). Yields (provider, sender, released): ``released`` gets one bool per
    approval, whether the lease was released by then; ``sender.send(None)`` posts the event."""
    from spotguard.checkpoint import lease as lease_record
    from spotguard.notices.azure import AzureProvider
    from spotguard.ops.rehearsal.notices import make_sender

    released: list[bool] = []

    class Watched(AzureProvider):
        def acknowledge(self, notice: Any) -> None:
            record = lease_record.read(storage)
            released.append(record is not None and record.released)
            super().acknowledge(notice)

    sender = make_sender("azure", 30.0, work_dir)
    try:
        for name, value in sender.env.items():
            monkeypatch.setenv(name, value)
        yield Watched(vm_name="spot-trainer-1"), sender, released
    finally:
        sender.close()


def wait_until(ready: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``ready`` every 20 ms; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def wait_exit(pid: int, deadline: float, poll: float = 0.01) -> int:
    """The exit code of child ``pid`` (``os.waitstatus_to_exitcode``); SIGKILLed once past ``deadline``
    (``time.monotonic()``), then reaped."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(poll)
