"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from . import torch_ext, xdist_order
from .helpers import DDP_ARGS, block_cloud_metadata, ddp_example_cmd, read_losses, run, run_example

# Never let cloud detection (providers="auto", here or in child processes) reach a real metadata
# address: every endpoint variable points at a 127.0.0.1 port that refuses connections.
block_cloud_metadata()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) times every test
        config.pluginmanager.register(xdist_order.Durations(), "spotguard-test-seconds")
        torch_ext.prepare()  # before the workers start: they and their jobs inherit the folder


def pytest_unconfigure(config: pytest.Config) -> None:
    torch_ext.stop()


def pytest_collection_finish(session: pytest.Session) -> None:
    torch_ext.build_if_used(session.config, session.items)  # in a worker, or a run without xdist


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` gives out the longest files first (tests/xdist_order.py)."""
    return xdist_order.make_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


#: The signals whose handling a child inherits when ignored: a test that leaves one ignored in this worker
#: makes every later child ignore it too (a batch shell cannot even ``trap`` it), far from the cause.
KEPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _stop_signals_kept():
    """Fails a test that changed how this process handles a stop signal and did not give it back (the
    Guard's and the supervisor's handlers restore them on close); puts them back for the next test."""
    before = {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS}
    yield
    changed = [sig.name for sig, handler in before.items() if signal.getsignal(sig) != handler]
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert not changed, f"the test left the handling of {', '.join(changed)} changed"


_leases: list[object] = []  # the writer leases the running test acquired


@pytest.fixture(autouse=True)
def _leftover_leases_stop():
    """A test that leaves a Guard open (the "machine is gone" mid-run) left its writer lease's renewal
    thread running into the next tests of the same worker, whose ``caplog`` then caught its warnings
    (a renewal, or the release once the Guard was collected, against a server the test had stopped).
    When the test ends, each lease it acquired stops renewing, without a write: the record expires.
    Only where the lease module is imported already: a light test file does not import torch here."""
    module = sys.modules.get("spotguard.checkpoint.leaseholder")
    if module is not None and not hasattr(module.Lease, "_seen_by_tests"):
        acquire = module.Lease.acquire

        def seen(self, *args, **kwargs):
            _leases.append(self)
            return acquire(self, *args, **kwargs)

        module.Lease.acquire, module.Lease._seen_by_tests = seen, True
    yield
    for lease in _leases:
        lease._stop.set()  # the renewal thread ends at its next wait
    _leases.clear()


def _computed_once(factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], None]) -> Path:
    """A folder that ``compute`` fills once per test run, shared by pytest-xdist's workers (a file lock
    between them; a folder marked done is reused): reference runs cost seconds of CPU each."""
    from filelock import FileLock

    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder = root / f"shared-{name}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a run that failed half way
            folder.mkdir()
            compute(folder)
            (folder / ".done").touch()
    return folder


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted example runs, computed once per configuration: ``get(*args) -> (losses, final path)``."""

    def compute(args: tuple[str, ...], d: Path) -> None:
        proc = run_example(d / "ckpt", *args, "--losses", str(d / "losses.jsonl"), "--final", str(d / "final.pt"))
        assert proc.returncode == 0, proc.stderr

    def get(*args: str) -> tuple[list[tuple[int, float]], Path]:
        key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]
        d = _computed_once(tmp_path_factory, f"reference-{key}", lambda folder: compute(args, folder))
        return read_losses(d / "losses.jsonl"), d / "final.pt"

    return get


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted examples/train_ddp.py run of 2 ranks with DDP_ARGS, computed once: a folder with
    ``loss-{rank}.jsonl`` and ``final.pt`` (2 ranks on one node or 2 nodes of 1 rank train alike)."""

    def compute(ref: Path) -> None:
        done = run(
            ddp_example_cmd(
                2,
                ref / "ckpt",
                *DDP_ARGS,
                "--providers",
                "signal",
                "--losses",
                str(ref / "loss-{rank}.jsonl"),
                "--final",
                str(ref / "final.pt"),
            )
        )
        assert done.returncode == 0, done.stderr[-3000:]

    return _computed_once(tmp_path_factory, "ddp-reference", compute)


@pytest.fixture
def mock_metadata():
    """Start mock metadata servers over real HTTP on 127.0.0.1: ``mock_metadata("aws", **options)``."""
    from spotguard.ops.mockmeta import MockMetadataServer, make_mock

    servers = []

    def start(cloud: str, *, error_rate: float = 0.0, **options):
        server = MockMetadataServer(make_mock(cloud, **options), error_rate=error_rate, seed=0).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
