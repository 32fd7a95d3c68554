"""``spotguard ls / verify / pull / rm`` on S3 (moto server), GCS (fake-gcs-server), Azure (Azurite) and a local directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from spotguard import checkpoint
from spotguard.ops.cli import main
from spotguard.storage import open_storage
from tests.helpers import subprocess_env
from tests.storage.test_s3 import corrupt_in_moto


@pytest.fixture(params=["local", "s3", "azure"])
def url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return request.getfixturevalue("s3_url" if request.param == "s3" else "az_url")


def fill(url: str) -> dict[int, bytes]:
    st = open_storage(url)
    payloads = {}
    for step in (10, 20):
        payloads[step] = os.urandom(50_000 + step)
        checkpoint.write(st, step, {"state.pt": lambda f, d=payloads[step]: f.write(d)}, reason="periodic")
    st.put_bytes("step-00000030/state.pt", b"leftover of a killed save")
    return payloads


def test_pull_copies_a_verified_checkpoint_into_a_local_root(url, tmp_path, capsys):
    payloads = fill(url)
    dest = tmp_path / "pulled"
    assert main(["pull", url, str(dest)]) == 0  # newest complete: step 20
    assert (dest / "step-00000020" / "state.pt").read_bytes() == payloads[20]
    assert main(["pull", url, "--step", "10", str(dest)]) == 0
    assert (dest / "step-00000010" / "state.pt").read_bytes() == payloads[10]
    assert main(["verify", str(dest)]) == 0
    assert main(["pull", url, "--step", "20", str(dest)]) == 1  # never overwrites
    assert main(["pull", url, "--step", "30", str(dest)]) == 1  # incomplete
    assert "incomplete" in capsys.readouterr().err


def test_rm_step_and_incomplete(url, capsys):
    fill(url)
    assert main(["rm", url, "--incomplete"]) == 0  # step 30 was written just now: a save may be writing it
    assert "skipped" in capsys.readouterr().out and len(checkpoint.scan(open_storage(url))) == 3
    assert main(["rm", url, "--incomplete", "--min-age", "0"]) == 0
    assert [(i.step, i.status) for i in checkpoint.scan(open_storage(url))] == [(10, "complete"), (20, "complete")]
    assert main(["rm", url, "--step", "10"]) == 0
    assert [i.step for i in checkpoint.scan(open_storage(url))] == [20]
    assert main(["rm", url, "--step", "10"]) == 1
    assert main(["rm", url, "--incomplete"]) == 0
    assert "nothing incomplete" in capsys.readouterr().out


def test_rm_incomplete_aborts_dangling_multipart_uploads(s3_url, capsys):
    st = open_storage(s3_url)
    client = boto3.client("s3")
    client.create_multipart_upload(Bucket=st.bucket, Key="run/step-00000040/state.pt")
    client.create_multipart_upload(Bucket=st.bucket, Key="elsewhere/x")  # outside the prefix: kept
    assert main(["rm", s3_url, "--incomplete", "--min-age", "0"]) == 0
    assert "step-00000040/state.pt (multipart upload" in capsys.readouterr().out
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=st.bucket).get("Uploads", [])]
    assert left == ["elsewhere/x"]


def test_ls_shows_corrupt_with_exit_0_and_verify_exits_1(s3_url, tmp_path, capsys):
    fill(s3_url)
    corrupt_in_moto(open_storage(s3_url).bucket, "run/step-00000020/state.pt")
    assert main(["ls", s3_url]) == 0
    out = capsys.readouterr().out
    assert "incomplete" in out and out.count("complete") >= 3
    assert main(["verify", s3_url]) == 1
    out = capsys.readouterr().out
    assert "step-00000020: CORRUPT" in out and "step-00000010: ok" in out
    assert main(["verify", s3_url + "/step-00000010"]) == 0
    assert main(["pull", s3_url, "--step", "20", str(tmp_path / "dest")]) == 2  # the corruption is reported
    assert "CRC32" in capsys.readouterr().err


def truncate(url: str, key: str) -> None:
    """Cut an object to half its length in the server itself, the way a broken writer would leave it."""
    if url.startswith("s3://"):
        from moto.core.models import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        bucket, _, prefix = url[len("s3://") :].partition("/")
        obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, f"{prefix}/{key}")
        obj.value = obj.value[: len(obj.value) // 2]
    elif url.startswith("az://"):  # Azurite: write it again, shorter (the stored CRC32 goes with the old one)
        from azure.storage.blob import BlobServiceClient

        container, _, prefix = url[len("az://") :].partition("/")
        with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
            blob = service.get_blob_client(container, f"{prefix}/{key}")
            data = blob.download_blob().readall()
            blob.upload_blob(data[: len(data) // 2], overwrite=True)
    elif url.startswith("gs://"):  # fake-gcs-server keeps objects in its own memory: rewrite it shorter
        from google.cloud import storage

        bucket, _, prefix = url[len("gs://") :].partition("/")
        blob = storage.Client().bucket(bucket).blob(f"{prefix}/{key}")
        data = blob.download_as_bytes()
        blob.upload_from_string(data[: len(data) // 2])
    else:
        path = Path(url) / key
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("kind", ["local", "s3", "gcs", "azure"])
def test_ls_shows_a_truncated_object_as_corrupt_and_verify_exits_1(kind, request, tmp_path, capsys):
    url = {
        "local": lambda: str(tmp_path / "ckpt"),
        "s3": lambda: request.getfixturevalue("s3_url"),
        "gcs": lambda: request.getfixturevalue("fake_gcs_url"),
        "azure": lambda: request.getfixturevalue("az_url"),
    }[kind]()
    fill(url)
    assert main(["ls", url]) == 0
    assert capsys.readouterr().out.count("  complete") == 2
    assert main(["verify", url]) == 0
    capsys.readouterr()
    truncate(url, "step-00000020/state.pt")
    assert main(["ls", url]) == 0  # it could list: exit 0, corrupt entries shown
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["10"].endswith("  complete (unverified)") and "incomplete" in lines["30"]
    assert "corrupt (step-00000020/state.pt: 25010 bytes, the manifest says 50020)" in lines["20"]
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "step-00000020: CORRUPT" in out and "step-00000010: ok" in out


@pytest.mark.parametrize(
    ("url", "blocked", "extra"),
    [
        ("s3://bucket/run", "boto3", "aws"),
        ("gs://bucket/run", "google.cloud.storage", "gcp"),
        ("az://container/run", "azure.storage.blob", "azure"),
        ("abfss://container@acct.dfs.core.windows.net/run", "azure.storage.blob", "azure"),
    ],
)
def test_a_missing_sdk_is_named_with_the_extra_to_install(url, blocked, extra):
    """A fresh interpreter where the SDK cannot be imported (None in sys.modules blocks the import)."""
    code = (
        f"import sys\nsys.modules[{blocked!r}] = None\nfrom spotguard.ops.cli import main\n"
        f"sys.exit(main(['ls', {url!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"pip install 'spotguard[{extra}]'" in out.stderr and blocked in out.stderr


def test_verify_with_nothing_to_verify_exits_1_with_a_message(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "no-such-run")]) == 1
    assert "(it does not exist): nothing to verify" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert f"no checkpoints in {tmp_path / 'empty'}: nothing to verify" in capsys.readouterr().err
    assert not (tmp_path / "no-such-run").exists()  # looking created nothing


def test_ls_never_calls_unread_contents_complete_and_verifies_with_verify(tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    fill(url)
    path = tmp_path / "ckpt" / "step-00000020" / "state.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, other content: only reading it shows
    path.write_bytes(bytes(data))
    assert main(["ls", url]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["20"].endswith("  complete (unverified)") and lines["10"].endswith("  complete (unverified)")
    assert "--verify reads every file" in lines["(unverified:"]
    assert main(["ls", "--verify", url]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["10"].endswith("  complete (verified)")
    assert "corrupt (step-00000020/state.pt: BLAKE3 checksum does not match the manifest)" in lines["20"]
    assert main(["ls", "--verify", "--json", url]) == 0
    rows = {r["step"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (rows[10]["status"], rows[10]["verified"]) == ("complete", True)
    assert (rows[20]["status"], rows[20]["verified"]) == ("corrupt", False) and "does not match" in rows[20]["problem"]
    assert rows[30]["verified"] is None
    assert main(["ls", "--json", url]) == 0
    assert {r["step"]: r["verified"] for r in map(json.loads, capsys.readouterr().out.splitlines())} == {
        10: None,
        20: None,
        30: None,
    }


def test_pull_between_local_folders_makes_copies_of_their_own_not_links(tmp_path):
    """A file rewritten in the pulled copy (a user's torch.save over it) must not rewrite the original."""
    src, dest = str(tmp_path / "ckpt"), tmp_path / "pulled"
    payloads = fill(src)
    assert main(["pull", src, "--step", "20", str(dest)]) == 0
    original, pulled = tmp_path / "ckpt" / "step-00000020" / "state.pt", dest / "step-00000020" / "state.pt"
    assert original.stat().st_ino != pulled.stat().st_ino
    pulled.write_bytes(b"rewritten in place")
    assert original.read_bytes() == payloads[20]
    assert main(["verify", src]) == 0


def test_a_pull_beaten_to_its_step_by_another_writer_deletes_nothing_of_that_writer(tmp_path, monkeypatch, capsys):
    """The destination is a live run's storage, which commits the same step during the pull: the pull fails
    (its manifest refused) and leaves that run's checkpoint as it is, instead of removing it as a partial copy."""
    src, dest = str(tmp_path / "ckpt"), str(tmp_path / "live")
    fill(src)
    real_copy = checkpoint.copy

    def beaten(source, target, info, **kw):
        real_copy(source, target, info, verify=True)  # the live run's commit of that step
        return real_copy(source, target, info, **kw)

    monkeypatch.setattr(checkpoint, "copy", beaten)
    assert main(["pull", src, "--step", "20", dest]) != 0
    assert [(i.step, i.status) for i in checkpoint.scan(open_storage(dest))] == [(20, "complete")]
    checkpoint.verify(open_storage(dest), checkpoint.scan(open_storage(dest))[0])
    assert "left as it is" in capsys.readouterr().err
