"""No credential in any log: ``spotguard -vv ls`` and ``-vvv pull`` on S3 (moto, session
credentials), GCS (gcp-storage-emulator reached with a bearer token from a service account) and Azure
(Azurite, with the account key and with a SAS). Each run's stdout and stderr together must hold none of
the secret values, while the SDKs' wire logs are there (so the check is not vacuous)."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from spotguard import checkpoint
from spotguard.storage import open_storage
from tests.helpers import subprocess_env
from tests.storage.conftest import AZURITE_KEY, Server, azurite_connection

SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONtoken0123456789abcdef/+=="
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
BEARER = "ya29.a0AfExampleBearerToken-0123456789_abcdef"
SIGNATURE = re.compile(r"Signature=[0-9a-f]{64}|Signature:\s*[0-9a-f]{64}")


def commit_one(url: str) -> None:
    checkpoint.write(open_storage(url), 10, {"state.pt": lambda f: f.write(b"x" * 4096)}, reason="periodic")


def cli_logs(url: str, env: dict[str, str], dest: Path) -> str:
    """stdout + stderr of ``-vv ls`` and ``-vvv pull`` (with the SDKs' wire logs: list, read, verify, copy)."""
    out = ""
    for args in (["-vv", "ls", url], ["-vvv", "pull", url, str(dest)]):
        proc = subprocess.run(
            [sys.executable, "-m", "spotguard", *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out += proc.stdout + proc.stderr
    return out


def assert_clean(out: str, secrets: list[str]) -> None:
    for secret in secrets:
        lines = [line for line in out.splitlines() if secret in line]
        assert not lines, f"{secret[:12]}... logged in {len(lines)} line(s), first: {lines[0][:300]}"
    assert not SIGNATURE.search(out)
    shown = re.findall(r"(?i)authorization['\"]?\s*:\s*b?['\"]?([^'\"\s,}]*)", out)
    assert set(shown) <= {"<redacted>", "REDACTED"}, set(shown)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_s3_session_credentials_never_reach_the_log(s3_url, tmp_path):
    commit_one(s3_url)
    env = subprocess_env(AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_SESSION_TOKEN=SESSION_TOKEN)
    out = cli_logs(s3_url, env, tmp_path / "pulled")
    assert "botocore.endpoint" in out and "<redacted>" in out  # the wire log was there, masked
    assert_clean(out, [SESSION_TOKEN, SECRET_KEY])


class _TokenEndpoint(BaseHTTPRequestHandler):
    """A token endpoint: every JWT assertion buys ``BEARER``."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"access_token": BEARER, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def token_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/token"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gcs_bearer_token_never_reaches_the_log(gcp_emulator: Server, gcp_emulator_url, token_endpoint, tmp_path):
    """Through API_ENDPOINT_OVERRIDE (not STORAGE_EMULATOR_HOST) the client authenticates: a service
    account's JWT goes to the local token endpoint, and every request carries ``Bearer BEARER``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    commit_one(gcp_emulator_url)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    account = tmp_path / "sa.json"
    account.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "test",
                "private_key_id": "k1",
                "private_key": pem,
                "client_email": "trainer@test.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": token_endpoint,
            }
        )
    )
    env = subprocess_env(
        API_ENDPOINT_OVERRIDE=gcp_emulator.url,
        GOOGLE_APPLICATION_CREDENTIALS=str(account),
        GOOGLE_CLOUD_PROJECT="test",
        GOOGLE_SDK_PYTHON_LOGGING_SCOPE="google",  # google-auth's and api-core's own request logs too
    )
    env.pop("STORAGE_EMULATOR_HOST")
    out = cli_logs(gcp_emulator_url, env, tmp_path / "pulled")
    assert "POST /token" in out  # the bearer token was fetched and used (the wire log is on)
    key_lines = [line for line in pem.splitlines() if "PRIVATE KEY" not in line]
    assert_clean(out, [BEARER, *key_lines])


def _sas(port: int) -> tuple[str, str]:
    """A connection string with an account SAS for Azurite, and the SAS signature (URL-decoded)."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    sas = generate_account_sas(
        "devstoreaccount1",
        AZURITE_KEY,
        ResourceTypes(service=True, container=True, object=True),
        AccountSasPermissions(read=True, write=True, list=True, delete=True, create=True, add=True),
        expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1),
    )
    sig = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    conn = f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;SharedAccessSignature={sas}"
    return conn, sig


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("auth", ["sas", "key"])
def test_azure_key_and_sas_never_reach_the_log(auth, azurite: Server, az_url, tmp_path):
    from urllib.parse import unquote

    commit_one(az_url)
    if auth == "sas":
        conn, sig = _sas(azurite.port)
        secrets = [sig, unquote(sig)]
    else:
        conn, secrets = azurite_connection(azurite.port), [AZURITE_KEY]
    out = cli_logs(az_url, subprocess_env(AZURE_STORAGE_CONNECTION_STRING=conn), tmp_path / "pulled")
    assert "urllib3.connectionpool" in out  # the wire log was there
    assert_clean(out, secrets)
    if auth == "sas":
        assert "sig=<redacted>" in out
