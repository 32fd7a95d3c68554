"""The Storage contract, run unchanged against every backend: local disk, S3 (moto server), GCS and
Azure Blob (Azurite).

GCS runs on fake-gcs-server here because the contract includes write-once ``put_bytes``, and it is
the emulator that enforces ``if_generation_match`` (gcp-storage-emulator ignores it).
Small part/chunk/block sizes make S3 go multipart, GCS resumable and Azure go block by block for the 11
MiB objects.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spotguard import checkpoint
from spotguard.errors import CheckpointExistsError, ConfigError
from spotguard.storage import LocalStorage, ObjectNotFoundError, Storage, open_storage
from spotguard.storage.azure import AzureOptions, AzureStorage
from spotguard.storage.gcs import GCSOptions, GCSStorage
from spotguard.storage.retry import RetryOptions
from spotguard.storage.s3 import S3Options, S3Storage
from tests.helpers import subprocess_env

MiB = 1 << 20


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "local":
        st: Storage = open_storage(str(tmp_path / "ckpt"))
    elif request.param == "s3":
        st = S3Storage(
            request.getfixturevalue("s3_url"), S3Options(part_size=5 * MiB, multipart_threshold=5 * MiB, page_size=10)
        )
    elif request.param == "gcs":
        st = GCSStorage(
            request.getfixturevalue("fake_gcs_url"), GCSOptions(chunk_size=MiB, resumable_threshold=MiB, page_size=10)
        )
    else:
        st = AzureStorage(
            request.getfixturevalue("az_url"),
            AzureOptions(block_size=4 * MiB, single_put_threshold=4 * MiB, page_size=10),
        )
    yield st
    st.close()


def test_open_write_roundtrips_large_objects(storage: Storage):
    data = os.urandom(11 * MiB + 123)
    with storage.open_write("step-00000001/state.pt") as f:
        f.write(data[:5])
        f.write(data[5:])
    with storage.local_copy("step-00000001/state.pt") as path:
        assert path.read_bytes() == data
    assert storage.list("") == ["step-00000001/state.pt"]
    assert storage.list_sizes("step-00000001/") == {"step-00000001/state.pt": len(data)}


def test_failed_write_leaves_nothing(storage: Storage):
    with pytest.raises(RuntimeError):
        with storage.open_write("a/obj") as f:
            f.write(b"partial")
            raise RuntimeError("writer died")
    assert storage.list("") == []
    assert not storage.exists("a/obj")


def test_put_get_and_exclusive_is_write_once(storage: Storage):
    storage.put_bytes("s/manifest.json", b"first", exclusive=True)
    with pytest.raises(CheckpointExistsError):
        storage.put_bytes("s/manifest.json", b"second", exclusive=True)
    assert storage.get_bytes("s/manifest.json") == b"first"
    storage.put_bytes("s/manifest.json", b"first", exclusive=True)  # a retried write of the same bytes
    storage.put_bytes("s/manifest.json", b"replaced")  # non-exclusive overwrites
    assert storage.get_bytes("s/manifest.json") == b"replaced"


def test_list_paginates_and_filters_by_prefix(storage: Storage):
    keys = [f"step-{i:08d}/f" for i in range(35)] + ["step-1x/f", "other"]  # 37 keys: 4 pages of 10
    for k in keys:
        storage.put_bytes(k, k.encode())
    assert storage.list("") == sorted(keys)
    assert storage.list("step-0000003") == [f"step-0000003{i}/f" for i in range(5)]
    assert storage.list("step-00000003/") == ["step-00000003/f"]
    assert storage.list("nothing/") == []


def test_delete_ignores_missing_and_exists_follows(storage: Storage):
    storage.put_bytes("a/b/c", b"1")
    storage.put_bytes("a/d", b"2")
    assert storage.exists("a/b/c") and not storage.exists("a/b")
    storage.delete(["a/b/c", "a/missing"])
    assert storage.list("") == ["a/d"]
    storage.delete(["a/d"])
    assert storage.list("") == []


def test_missing_objects_raise_not_found(storage: Storage):
    with pytest.raises(ObjectNotFoundError):
        storage.get_bytes("nope/manifest.json")
    with pytest.raises(ObjectNotFoundError):
        with storage.local_copy("nope/state.pt"):
            pass


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../b", "a//b", "", "a/./b", "a\\b"])
def test_traversal_keys_are_rejected(storage: Storage, key: str):
    with pytest.raises(ConfigError):
        storage.put_bytes(key, b"x")
    with pytest.raises(ConfigError):
        storage.get_bytes(key)
    with pytest.raises(ConfigError):
        storage.delete([key])


def test_checkpoint_layer_works_unchanged(storage: Storage):
    for step in (10, 20, 30):
        checkpoint.write(storage, step, {"state.pt": lambda f, s=step: f.write(bytes([s]) * 1000)}, reason="periodic")
    with pytest.raises(CheckpointExistsError):
        checkpoint.write(storage, 30, {"state.pt": lambda f: f.write(b"again")}, reason="manual")
    storage.put_bytes("step-00000040/state.pt", b"leftover")  # no manifest: an interrupted save
    infos = checkpoint.scan(storage)
    assert [(i.step, i.status) for i in infos] == [
        (10, "complete"),
        (20, "complete"),
        (30, "complete"),
        (40, "incomplete"),
    ]
    with checkpoint.open_verified(storage, infos[2], "state.pt") as path:
        assert path.read_bytes() == bytes([30]) * 1000
    assert checkpoint.prune(storage, keep=1) == [10, 20]
    assert [i.step for i in checkpoint.scan(storage)] == [30, 40]


@pytest.mark.parametrize(
    "url",
    [
        "s3://",
        "s3:///x",
        "gs://b/../x",
        "gs://b/x?y=1",
        "az://",
        "az://Bad_Name/x",
        "az://ok-name/x",
        "az://ok-name/../x",
        "abfss://ok-name/x",
        "abfss://ok-name@acct.example.com/x",
        "az://ok-name@Bad.blob.core.windows.net/x",
    ],
)
def test_bad_urls_are_config_errors(url: str, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(ConfigError):
        open_storage(url)


def test_the_storage_package_imports_no_cloud_sdk():
    """The SDKs are optional extras: only opening an s3://, gs:// or az:// URL imports one."""
    code = (
        "import sys\nimport spotguard.storage, spotguard.storage.cloud\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'boto3', 'botocore', 'google', 'azure'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("url", ["s3://[bucket/x", "gs://my bucket/x"])
def test_malformed_urls_are_config_errors(url: str):
    with pytest.raises(ConfigError, match="invalid storage URL"):
        open_storage(url)


@pytest.mark.parametrize(
    ("url", "meant"),
    [("s3//bucket/run", "s3://bucket/run"), ("gs:/b/run", "gs://b/run"), ("az:acct/c", "az://acct/c")],
)
def test_a_mistyped_cloud_url_is_refused_not_taken_for_a_local_folder(url: str, meant: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"did you mean {meant}"):
        open_storage(url)
    assert list(tmp_path.iterdir()) == []  # no ./s3/bucket/run folder on a disk that goes with the machine


@pytest.mark.parametrize("path", ["s3/bucket", "gs_runs/x", "./s3//x", "run:1"])
def test_local_paths_that_only_start_like_a_scheme_stay_local(path: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(open_storage(path), LocalStorage)


@pytest.mark.parametrize(
    "make",
    [
        lambda: S3Options(part_size="16MiB"),
        lambda: S3Options(concurrency=2.5),
        lambda: S3Options(read_timeout="60"),
        lambda: S3Options(endpoint_url="127.0.0.1:9000"),
        lambda: S3Options(endpoint_url="http://h:port"),
        lambda: S3Options(retry={"attempts": 3}),
        lambda: GCSOptions(timeout=None),
        lambda: GCSOptions(page_size=True),
        lambda: GCSOptions(chunk_size=MiB + 1),
        lambda: AzureOptions(block_size=1.5),
        lambda: AzureOptions(account_url="blob.example.com"),
        lambda: AzureOptions(urgent_timeout=float("nan")),
        lambda: RetryOptions(initial="0.2"),
        lambda: RetryOptions(attempts=2.0),
    ],
)
def test_bad_option_values_are_config_errors(make):
    """Wrong types too: a TypeError deep inside an upload would name neither the option nor the fix."""
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_listing_and_latest_span_more_than_one_default_page(kind, request):
    """1,100 objects with the default page size (1,000): both pages are listed and the newest
    checkpoint (sorted last) is found. fake-gcs-server for GCS, as above."""
    from concurrent.futures import ThreadPoolExecutor

    st: Storage = open_storage(
        request.getfixturevalue({"s3": "s3_url", "gcs": "fake_gcs_url", "azure": "az_url"}[kind])
    )
    keys = [f"step-{i:08d}/state.pt" for i in range(1099)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: st.put_bytes(k, b"x"), keys))
    checkpoint.write(st, 5000, {"state.pt": lambda f: f.write(b"newest")}, reason="periodic")
    assert len(st.list("")) == 1101
    info = checkpoint.latest(st)
    assert info is not None and info.step == 5000
