"""Azure Blob specifics against Azurite: URL forms and credentials, blocks with a digest the
service checks (tests/storage/test_upload_checksum.py: the writer's digests), integrity on read, fail-fast permanent errors, deadline-bounded retries, and no
trace on the global random streams."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time

import pytest
from azure.storage.blob import BlobServiceClient

from spotguard import checkpoint
from spotguard.errors import CheckpointCorruptError, ConfigError, StorageAccessError, StorageError
from spotguard.storage import open_storage
from spotguard.storage.azure import META_CRC, AzureOptions, AzureStorage
from spotguard.storage.retry import RetryOptions
from tests.faultproxy import FaultProxy
from tests.helpers import subprocess_env
from tests.storage.conftest import azurite_connection, make_container

MiB = 1 << 20
FAST_RETRY = RetryOptions(attempts=3, initial=0.01, maximum=0.05)
_AZURE_ENV = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)


@pytest.fixture
def no_azure_env(monkeypatch):
    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_connection_string_url_talks_to_the_emulator(az_url: str, azurite):
    st = open_storage(az_url)  # AZURE_STORAGE_CONNECTION_STRING comes from the environment
    assert isinstance(st, AzureStorage) and st.account == "devstoreaccount1" and st.prefix == "run/"
    st.put_bytes("k", b"v")
    container = az_url.split("/")[2]
    with BlobServiceClient.from_connection_string(azurite_connection(azurite.port)) as service:
        blob = service.get_blob_client(container, "run/k")
        assert blob.download_blob().readall() == b"v"
        assert blob.get_blob_properties().metadata[META_CRC]
    # The Data Lake form naming the connection string's account reaches the same blobs.
    assert open_storage(f"abfss://{container}@devstoreaccount1.dfs.core.windows.net/run").get_bytes("k") == b"v"


@pytest.mark.parametrize(
    ("url", "env", "account_url", "prefix"),
    [
        ("az://ckpt@myacct.blob.core.windows.net/runs/r1", {}, "https://myacct.blob.core.windows.net/ckpt", "runs/r1/"),
        ("abfss://ckpt@myacct.dfs.core.windows.net/runs", {}, "https://myacct.blob.core.windows.net/ckpt", "runs/"),
        ("abfs://ckpt@myacct.dfs.core.chinacloudapi.cn/r", {}, "https://myacct.blob.core.chinacloudapi.cn/ckpt", "r/"),
        ("az://ckpt/r", {"AZURE_STORAGE_ACCOUNT_NAME": "myacct"}, "https://myacct.blob.core.windows.net/ckpt", "r/"),
        # A connection string for another account (a developer's emulator) is not used for this one.
        (
            "az://ckpt@myacct.blob.core.windows.net/r",
            {"AZURE_STORAGE_CONNECTION_STRING": azurite_connection(1)},
            "https://myacct.blob.core.windows.net/ckpt",
            "r/",
        ),
    ],
)
def test_url_forms_reach_the_blob_endpoint_with_the_default_credential_chain(
    no_azure_env, url, env, account_url, prefix
):
    from azure.identity import DefaultAzureCredential

    for k, v in env.items():
        no_azure_env.setenv(k, v)
    st = open_storage(url)
    assert isinstance(st, AzureStorage)
    assert st.container.url == account_url and st.prefix == prefix and st.account == "myacct"
    assert isinstance(st.container.credential, DefaultAzureCredential)


def test_missing_credentials_fail_fast_naming_the_fixes(no_azure_env, tmp_path):
    """No connection string, no identity anywhere: the default chain finds no token, and that is
    not retried (the token is asked for before any request reaches the account)."""
    no_azure_env.setenv("AZURE_TOKEN_CREDENTIALS", "dev")  # developer tools only: no 169.254.169.254 probe here
    no_azure_env.setenv("AZURE_CONFIG_DIR", str(tmp_path))  # an Azure CLI, if installed, is logged in nowhere
    st = AzureStorage("az://ckpt@nosuchacct0.blob.core.windows.net/run", AzureOptions(retry=RetryOptions(attempts=5)))
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        st.list()
    assert time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "az://ckpt@nosuchacct0.blob.core.windows.net/run" in msg and "no Azure credentials found" in msg
    assert "az login" in msg and "AZURE_STORAGE_CONNECTION_STRING" in msg
    assert isinstance(err.value, StorageAccessError)


def test_an_account_must_be_named_and_a_connection_string_must_be_readable(no_azure_env):
    with pytest.raises(ConfigError, match="names no storage account.*AZURE_STORAGE_ACCOUNT_NAME"):
        open_storage("az://ckpt/run")
    no_azure_env.setenv("AZURE_STORAGE_ACCOUNT_NAME", "Not_An-Account")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_NAME='Not_An-Account' is not a storage account"):
        open_storage("az://ckpt/run")
    no_azure_env.setenv("AZURE_STORAGE_CONNECTION_STRING", "not a connection string")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING cannot be read"):
        open_storage("az://ckpt/run")


def test_blocks_carry_a_digest_so_blocks_damaged_on_the_way_are_refused_and_sent_again(
    az_url: str, azurite, monkeypatch
):
    """Half the Put Block requests reach Azurite with a flipped byte: the service refuses them
    (x-ms-content-crc64), the upload is retried, and the stored blob is exactly what was written."""
    container = az_url.split("/")[2]
    with FaultProxy(azurite.port, rate=0.5, faults=("corrupt",), only="blockid=", seed=2) as proxy:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(proxy.port))
        st = AzureStorage(
            az_url,
            AzureOptions(
                block_size=MiB,
                single_put_threshold=MiB,
                concurrency=3,
                retry=RetryOptions(attempts=10, initial=0.01, maximum=0.05),
            ),
        )
        seen: list[int] = []
        st.progress = seen.append
        data = os.urandom(3 * MiB + 5)
        with st.open_write("step-00000001/state.pt") as f:
            f.write(data)
    assert proxy.injected["corrupt"] > 0
    with BlobServiceClient.from_connection_string(azurite_connection(azurite.port)) as service:
        blob = service.get_blob_client(container, "run/step-00000001/state.pt")
        assert blob.download_blob().readall() == data
        committed, _ = blob.get_block_list("committed")
        assert len(committed) == 4  # four blocks of 1 MiB at most
    assert sum(seen) >= len(data)  # progress saw every byte (retried blocks again)


def test_corrupted_object_is_caught_on_read_and_resume_falls_back(az_url: str, azurite):
    """Azurite keeps blob data in extent files on disk: flip one byte of the stored object there."""
    st = open_storage(az_url)
    payloads = {}
    for step in (1, 2):
        payloads[step] = os.urandom(100_000)
        checkpoint.write(st, step, {"state.pt": lambda f, d=payloads[step]: f.write(d)}, reason="periodic")
    needle = payloads[2][40_000:40_064]
    for extent in (azurite.root / "__blobstorage__").iterdir():
        stored = bytearray(extent.read_bytes())
        at = stored.find(needle)
        if at >= 0:
            stored[at] ^= 0xFF
            extent.write_bytes(bytes(stored))
            break
    else:
        pytest.fail("the object's bytes were not found in Azurite's extents")
    with pytest.raises(CheckpointCorruptError, match="CRC32"):
        with st.local_copy("step-00000002/state.pt"):
            pass
    infos = checkpoint.scan(st)
    with pytest.raises(CheckpointCorruptError):
        checkpoint.verify(st, infos[1])
    checkpoint.verify(st, infos[0])  # the older one still verifies


def test_permanent_errors_fail_fast_naming_container_key_and_fix(azurite, monkeypatch):
    container = make_container(azurite.port)
    with FaultProxy(azurite.port, rate=1.0, faults=("403",)) as proxy:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(proxy.port))
        st = AzureStorage(f"az://{container}/run")
        t0 = time.monotonic()
        with pytest.raises(StorageError) as err:
            st.put_bytes("step-00000001/manifest.json", b"{}")
        assert time.monotonic() - t0 < 10 and proxy.requests == 1  # not retried (a retry would be a 2nd request)
    msg = str(err.value)
    assert f"az://{container}/run/step-00000001/manifest.json" in msg and "access denied" in msg
    assert "Storage Blob Data Contributor" in msg and isinstance(err.value, StorageAccessError)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(azurite.port))
    with pytest.raises(
        StorageAccessError,
        match="container 'no-such-container' does not exist in account 'devstoreaccount1'; create it",
    ):
        AzureStorage("az://no-such-container/x").list()


def test_retries_stop_at_the_callers_deadline(az_url: str, azurite):
    with FaultProxy(azurite.port, rate=1.0, faults=("503",)) as proxy:
        # account_url: the connection string's account and key, another endpoint (here the proxy).
        st = AzureStorage(
            az_url,
            AzureOptions(
                account_url=f"{proxy.url}/devstoreaccount1",
                retry=RetryOptions(attempts=100, initial=0.2, maximum=0.4, max_elapsed=60),
            ),
        )
        t0 = time.monotonic()
        # Either the retries stopped short of the deadline, or a request was in flight at it.
        with pytest.raises(StorageError, match="gave up after retries|at the deadline"):
            st.put_bytes("m", b"x", deadline=t0 + 1.5)
        took = time.monotonic() - t0
    assert 0.3 < took < 3.0, took  # retried, and given up at the deadline (1.5 s; slack for a busy 2-core box)
    assert proxy.requests >= 3


def test_transient_faults_are_retried_without_touching_global_random(az_url: str, azurite, monkeypatch, caplog):
    """30% of requests fail (drops, 5xx, resets, truncated replies) while a background thread saves."""
    random.seed(1234)
    before = random.getstate()
    with FaultProxy(azurite.port, rate=0.3, faults=("drop", "500", "503", "reset", "truncate"), seed=7) as proxy:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection(proxy.port))
        st = AzureStorage(
            az_url,
            AzureOptions(
                block_size=MiB, single_put_threshold=MiB, retry=FAST_RETRY, request_attempts=6, read_timeout=5
            ),
        )
        data = os.urandom(5 * MiB)
        errors: list[BaseException] = []

        def save() -> None:
            try:
                with st.open_write("step-00000001/state.pt") as f:
                    f.write(data)
                st.put_bytes("step-00000001/manifest.json", b"{}", exclusive=True)
                with st.local_copy("step-00000001/state.pt") as path:
                    assert path.read_bytes() == data
                assert st.list("") == ["step-00000001/manifest.json", "step-00000001/state.pt"]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        with caplog.at_level(logging.WARNING):
            t = threading.Thread(target=save)
            t.start()
            t.join(120)
        assert not errors, errors
        assert random.getstate() == before  # no retry jitter drawn from `random`
    assert sum(proxy.injected.values()) >= 3, proxy.injected


def test_token_refresh_jitter_does_not_draw_from_global_random():
    """azure-core's bearer-token policy draws a refresh jitter with each token (managed identity,
    az login ...): a backend with a token credential gives that module a private generator."""
    from azure.core.credentials import AccessToken
    from azure.core.pipeline.policies import BearerTokenCredentialPolicy

    class Credential:
        def get_token(self, *scopes, **kwargs):
            return AccessToken("token", int(time.time()) + 3600)

    AzureStorage("az://ckpt@someacct.blob.core.windows.net/run", credential=Credential()).close()
    policy = BearerTokenCredentialPolicy(Credential(), "https://storage.azure.com/.default")
    random.seed(7)
    before = random.getstate()
    policy._request_token("https://storage.azure.com/.default")
    assert random.getstate() == before


def test_importing_the_backend_leaves_azure_core_untouched():
    """The private generator is installed when a client with a token credential is built, not at import."""
    code = (
        "import random\nfrom azure.core.pipeline.policies import _authentication\n"
        "import spotguard.storage.azure\nprint(_authentication.random is random)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )  # a fresh process: nothing imported or patched yet
    assert out.stdout.strip() == "True", out.stderr


def test_an_account_that_does_not_resolve_is_named():
    """``.invalid`` never resolves (RFC 2606): the resolver fails at once, with or without a network."""
    from azure.core.credentials import AccessToken

    class Credential:
        def get_token(self, *scopes, **kwargs):
            return AccessToken("token", int(time.time()) + 3600)

    st = AzureStorage(
        "az://ckpt@nosuchacct.blob.core.windows.net/run",
        AzureOptions(
            account_url="https://nosuchacct.blob.core.invalid",
            request_attempts=1,
            retry=RetryOptions(attempts=2, initial=0.01, maximum=0.02),
        ),
        credential=Credential(),
    )
    with pytest.raises(StorageError, match="endpoint does not resolve.*check the account name 'nosuchacct'"):
        st.list()


def test_a_save_straight_to_azure_stages_blocks_while_its_file_is_written(az_url: str, azurite):
    """Blocks go up as they land, each with the digest its writer kept; the blob is what was written."""
    st = AzureStorage(az_url, AzureOptions(block_size=MiB, single_put_threshold=MiB, concurrency=3))
    data = os.urandom(40 * MiB + 3)
    staged = threading.Event()

    def writer(f) -> None:
        f.write(data[: 17 * MiB])  # one 16 MiB buffer lands: 16 blocks can go
        blob = st.container.get_blob_client(st._key("step-00000001/state.pt"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not staged.is_set():
            try:
                if blob.get_block_list("uncommitted")[1]:
                    staged.set()
            except Exception:  # noqa: BLE001 - no block yet: the blob does not exist
                pass
            time.sleep(0.05)
        f.write(data[17 * MiB :])

    checkpoint.write(st, 1, {"state.pt": writer}, reason="emergency")
    assert staged.is_set()
    (info,) = checkpoint.scan(st)
    checkpoint.verify(st, info)  # the CRC32 in the metadata and the manifest's checksum agree
    with st.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == data
