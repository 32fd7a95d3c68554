"""Shared fixtures (helpers live in tests/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import DDP_ARGS, block_cloud_metadata, ddp_example_cmd, read_losses, run, run_example

# Never let cloud detection (providers="auto", here or in child processes) reach a real metadata
# address: every endpoint variable points at a 127.0.0.1 port that refuses connections.
block_cloud_metadata()


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted example runs, computed once per configuration: {key: (losses, final_path)}."""
    cache: dict[tuple[str, ...], tuple[list[tuple[int, float]], Path]] = {}

    def get(*args: str) -> tuple[list[tuple[int, float]], Path]:
        if args not in cache:
            d = tmp_path_factory.mktemp("reference")
            losses, final = d / "losses.jsonl", d / "final.pt"
            proc = run_example(d / "ckpt", *args, "--losses", str(losses), "--final", str(final))
            assert proc.returncode == 0, proc.stderr
            cache[args] = (read_losses(losses), final)
        return cache[args]

    return get


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted examples/train_ddp.py run of 2 ranks with DDP_ARGS, computed once: a folder with
    ``loss-{rank}.jsonl`` and ``final.pt`` (2 ranks on one node or 2 nodes of 1 rank train alike)."""
    ref = tmp_path_factory.mktemp("ddp-reference")
    done = run(ddp_example_cmd(2, ref / "ckpt", *DDP_ARGS, "--providers", "signal",
                               "--losses", str(ref / "loss-{rank}.jsonl"), "--final", str(ref / "final.pt")))
    assert done.returncode == 0, done.stderr[-3000:]
    return ref


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
