"""The conditional write every backend implements for the writer lease: create-if-absent and
replace-if-unchanged, on local disk, S3 (moto server), GCS and Azure Blob (Azurite).

GCS runs on fake-gcs-server: it enforces generation preconditions on simple uploads, while
gcp-storage-emulator ignores ``if_generation_match`` entirely (a create over an existing object or a
replace of a stale generation would succeed there, so it cannot test a lease).
"""

from __future__ import annotations

import shutil
import threading

import pytest

from spotguard.errors import PreconditionFailedError, StorageError
from spotguard.storage import ObjectNotFoundError, Storage, open_storage
from spotguard.storage.azure import AzureStorage
from spotguard.storage.gcs import GCSStorage
from spotguard.storage.s3 import S3Storage

KEY = "spotguard-lease.json"


GCS_EMULATOR_SKIP = pytest.mark.skip(
    reason="gcp-storage-emulator ignores if_generation_match (a create over an existing object and a replace "
    "of a stale generation both succeed there): the GCS lease is tested on fake-gcs-server"
)


@pytest.fixture(params=["local", "s3", "gcs", pytest.param("gcs-emulator", marks=GCS_EMULATOR_SKIP), "azure"])
def storage(request: pytest.FixtureRequest, tmp_path) -> Storage:
    if request.param == "local":
        st: Storage = open_storage(str(tmp_path / "ckpt"))
    elif request.param == "s3":
        st = S3Storage(request.getfixturevalue("s3_url"))
    elif request.param == "gcs":
        st = GCSStorage(request.getfixturevalue("fake_gcs_url"))
    elif request.param == "gcs-emulator":
        st = GCSStorage(request.getfixturevalue("gcp_emulator_url"))
    else:
        st = AzureStorage(request.getfixturevalue("az_url"))
    yield st
    st.close()


def test_create_if_absent_refuses_an_existing_object(storage: Storage):
    first = storage.put_conditional(KEY, b"writer A", token=None)
    with pytest.raises(PreconditionFailedError, match="already exists"):
        storage.put_conditional(KEY, b"writer B", token=None)
    assert storage.get_versioned(KEY) == (b"writer A", first)


def test_replace_if_unchanged_refuses_a_changed_object(storage: Storage):
    storage.put_conditional(KEY, b"v1", token=None)
    data, v1 = storage.get_versioned(KEY)
    assert data == b"v1"
    v2 = storage.put_conditional(KEY, b"v2 by A", token=v1)
    assert v2 != v1
    with pytest.raises(PreconditionFailedError, match="another writer"):
        storage.put_conditional(KEY, b"v2 by B", token=v1)  # B read v1 too: A changed it since
    assert storage.get_versioned(KEY) == (b"v2 by A", v2)
    v3 = storage.put_conditional(KEY, b"v3 by A", token=v2)  # the token of its own write: A goes on
    assert storage.get_versioned(KEY) == (b"v3 by A", v3)


def test_replace_of_a_deleted_object_fails(storage: Storage):
    token = storage.put_conditional(KEY, b"v1", token=None)
    storage.delete([KEY])
    with pytest.raises(PreconditionFailedError):
        storage.put_conditional(KEY, b"v2", token=token)
    with pytest.raises(ObjectNotFoundError):
        storage.get_versioned(KEY)


def test_a_lost_reply_retried_with_the_same_bytes_counts_as_ours(storage: Storage):
    """The write landed but its reply was lost: the retry meets its own object, not a conflict."""
    token = storage.put_conditional(KEY, b"mine", token=None)
    assert storage.put_conditional(KEY, b"mine", token=None) == token


def test_only_one_of_many_concurrent_replacements_wins(storage: Storage):
    token = storage.put_conditional(KEY, b"v0", token=None)
    outcomes: list[str] = []

    def replace(i: int) -> None:
        try:
            storage.put_conditional(KEY, f"writer {i}".encode(), token=token)
            outcomes.append("won")
        except PreconditionFailedError:
            outcomes.append("refused")
        except StorageError as e:  # anything else is a failure of the test
            outcomes.append(f"error: {e}")

    threads = [threading.Thread(target=replace, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["refused"] * 5 + ["won"]


def test_a_replacement_never_recreates_a_deleted_local_folder(tmp_path):
    """A lease renewed after its run's folder was removed (``rm -r``) must not bring the folder back."""
    storage = open_storage(str(tmp_path / "run"))
    token = storage.put_conditional(KEY, b"v1", token=None)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(PreconditionFailedError):
        storage.put_conditional(KEY, b"v2", token=token)
    assert not (tmp_path / "run").exists()
