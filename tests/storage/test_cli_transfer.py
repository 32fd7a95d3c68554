"""``spotguard ls / verify / pull / rm`` on S3 (moto server) and on a local directory."""

from __future__ import annotations

import os

import boto3
import pytest

from spotguard import checkpoint
from spotguard.cli import main
from spotguard.storage import open_storage
from tests.storage.test_s3 import corrupt_in_moto


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else request.getfixturevalue("s3_url")


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
    assert main(["rm", url, "--incomplete"]) == 0
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
    assert main(["rm", s3_url, "--incomplete"]) == 0
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
