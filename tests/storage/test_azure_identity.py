"""The production credential path end to end: azure-identity's DefaultAzureCredential gets a token
from the VM's managed-identity endpoint (a local stand-in for 169.254.169.254, reached through
``AZURE_POD_IDENTITY_AUTHORITY_HOST``), with ``AZURE_CLIENT_ID`` naming the user-assigned identity
as terraform/azure sets it, and Azurite (HTTPS, ``--oauth basic``: it checks the token's issuer,
audience and lifetime, not its signature) accepts it as a bearer token."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from azure.storage.blob import BlobServiceClient

from spotguard import checkpoint
from spotguard.errors import StorageError
from spotguard.storage.azure import AzureOptions, AzureStorage
from tests.faultproxy import wait_for_port
from tests.helpers import free_port
from tests.storage.conftest import AZURITE, AZURITE_KEY, _stop, new_bucket

CLIENT_ID = "6f1b2a3c-0000-4000-8000-00000000abcd"


def _jwt(claims: dict) -> str:
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.{base64.urlsafe_b64encode(b'unsigned').rstrip(b'=').decode()}"


@dataclass
class Imds:
    """The managed-identity token endpoint of an Azure VM's metadata service."""

    audience: str = "https://storage.azure.com"
    seen: list[dict] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def imds() -> Iterator[Imds]:
    state = Imds()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            state.seen.append({"path": url.path, "metadata": self.headers.get("Metadata"), **query})
            if url.path != "/metadata/identity/oauth2/token" or self.headers.get("Metadata") != "true":
                self.send_response(400)
                self.end_headers()
                return
            now = int(time.time())
            token = _jwt(
                {
                    "aud": state.audience,
                    "iss": "https://sts.windows.net/00000000-0000-0000-0000-000000000001/",
                    "iat": now - 60,
                    "nbf": now - 60,
                    "exp": now + 3600,
                    "appid": query.get("client_id", ""),
                }
            )
            body = json.dumps(
                {
                    "access_token": token,
                    "expires_in": "3600",
                    "expires_on": str(now + 3600),
                    "resource": query.get("resource"),
                    "token_type": "Bearer",
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _self_signed(d: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def azurite_oauth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Azurite over HTTPS with bearer tokens checked: (account URL, its certificate)."""
    if not AZURITE.exists():
        pytest.fail("Azurite is missing in CI") if os.environ.get("CI") else pytest.skip("Azurite not installed")
    d = tmp_path_factory.mktemp("azurite-oauth")
    cert, key = _self_signed(d)
    port = free_port()
    proc = subprocess.Popen(
        [
            str(AZURITE),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--inMemoryPersistence",
            "--cert",
            str(cert),
            "--key",
            str(key),
            "--oauth",
            "basic",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ],
        cwd=d,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout=60)
        yield f"https://127.0.0.1:{port}/devstoreaccount1", cert
    finally:
        _stop(proc)


@pytest.fixture
def vm_env(azurite_oauth, imds, monkeypatch) -> tuple[str, str]:
    """The environment of a job on a terraform/azure VM: no keys, a managed identity. (URL, account URL)"""
    account_url, cert = azurite_oauth
    for name in (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_TENANT_ID",
        "AZURE_CLIENT_SECRET",
        "AZURE_FEDERATED_TOKEN_FILE",
        "IDENTITY_ENDPOINT",
        "IDENTITY_HEADER",
        "MSI_ENDPOINT",
        "AZURE_TOKEN_CREDENTIALS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_CLIENT_ID", CLIENT_ID)
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", imds.url)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    container = new_bucket()
    with BlobServiceClient(
        account_url,
        credential={"account_name": "devstoreaccount1", "account_key": AZURITE_KEY},
        connection_verify=str(cert),
    ) as service:
        service.create_container(container)
    return f"az://{container}@devstoreaccount1.blob.core.windows.net/run", account_url


def test_a_checkpoint_commits_and_verifies_with_the_vms_managed_identity(vm_env, imds):
    url, account_url = vm_env
    st = AzureStorage(url, AzureOptions(account_url=account_url))
    random.seed(3)
    before = random.getstate()
    checkpoint.write(st, 7, {"state.pt": lambda f: f.write(os.urandom(300_000))}, reason="periodic")
    info = checkpoint.latest(st)
    assert info is not None and info.step == 7
    checkpoint.verify(st, info)
    assert random.getstate() == before  # the token's refresh jitter came from a private generator
    tokens = [s for s in imds.seen if s["path"] == "/metadata/identity/oauth2/token"]
    assert tokens and all(s["metadata"] == "true" and s["client_id"] == CLIENT_ID for s in tokens)
    assert tokens[0]["resource"] == "https://storage.azure.com"


def test_a_token_the_account_refuses_fails_fast_as_access_denied(vm_env, imds):
    url, account_url = vm_env
    imds.audience = "https://vault.azure.net"  # a token for another service
    st = AzureStorage(url, AzureOptions(account_url=account_url))
    t0 = time.monotonic()
    with pytest.raises(
        StorageError,
        match=r"access denied \(AuthenticationFailed: Invalid token audience\.\).*"
        "Storage Blob Data Contributor",
    ):
        st.put_bytes("step-00000001/manifest.json", b"{}")
    assert time.monotonic() - t0 < 10  # not retried with backoff
