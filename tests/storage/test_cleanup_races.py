"""``spotguard rm --incomplete`` under races and odd names (issue 31): a step committed after the plan
stays, leftovers inside revision folders are found, one leftover that cannot go stops nothing else, and
no name forges a line of the output. Local folders, S3 (moto server) and GCS (fake-gcs-server)."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3

from spotguard import checkpoint
from spotguard.checkpoint.folders import cleanup
from spotguard.storage import open_storage
from tests.storage.test_cli_cleanup import age, backdate_in_moto, sg, write

TEMP = f"state.pt.tmp-{socket.gethostname()}@999999-0123abcd"  # a killed writer's temp file, as local storage names it


def test_local_temp_files_in_revision_folders_are_counted_and_removed(tmp_path):
    write(str(tmp_path), 10)
    rev = tmp_path / "step-00000010.r1"
    rev.mkdir()
    (rev / TEMP).write_bytes(b"x" * 1000)
    age(rev)
    assert "hidden: 1 temp file, 1.0 kB;" in sg("ls", str(tmp_path)).stdout
    out = sg("rm", str(tmp_path), "--incomplete")
    assert out.returncode == 0 and f"deleted {tmp_path}/step-00000010.r1/{TEMP} (temp file" in out.stdout, out.stdout
    assert not rev.exists() and checkpoint.scan(open_storage(str(tmp_path)))[0].complete


def test_s3_uploads_in_revision_folders_are_counted_and_aborted(s3_url):
    st = open_storage(s3_url)
    client = boto3.client("s3")
    key = "run/step-00000010.r2/state.pt"
    upload = client.create_multipart_upload(Bucket=st.bucket, Key=key)
    client.upload_part(Bucket=st.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * 1000)
    backdate_in_moto(st.bucket, "run/step-00000010.r2/")
    assert "hidden: 1 unfinished multipart upload, 1.0 kB;" in sg("ls", s3_url).stdout
    out = sg("rm", s3_url, "--incomplete")
    assert out.returncode == 0 and f"deleted {s3_url}/step-00000010.r2/state.pt (multipart upload" in out.stdout
    assert not client.list_multipart_uploads(Bucket=st.bucket).get("Uploads")


def test_gcs_parts_in_revision_folders_are_counted_and_removed(fake_gcs_url):
    st = open_storage(fake_gcs_url)
    st.bucket.blob("run/step-00000010.r1/state.pt.sg-part-0123456789ab-00").upload_from_string(b"p" * 1000)
    assert "hidden: 1 unfinished upload part, 1.0 kB;" in sg("ls", fake_gcs_url).stdout
    out = sg("rm", fake_gcs_url, "--incomplete", "--min-age", "0")
    assert out.returncode == 0 and "step-00000010.r1/state.pt.sg-part-0123456789ab-00 (upload part" in out.stdout
    assert not list(st.bucket.list_blobs())


def test_gcs_a_checkpoint_file_named_like_a_part_is_listed_and_kept(fake_gcs_url):
    st = open_storage(fake_gcs_url)
    name = "data.sg-part-1"  # legal: not the exact name of a composite upload's part
    checkpoint.write(st, 5, {name: lambda f: f.write(b"legal")}, reason="periodic")
    (info,) = checkpoint.scan(st)
    assert info.complete, info.problem
    assert cleanup.plan(st, 0).garbage == []
    checkpoint.verify(st, info)


def test_s3_a_step_committed_between_plan_and_removal_is_kept(s3_url):
    st = open_storage(s3_url)
    st.put_bytes("step-00000005/state.pt", b"killed save")
    backdate_in_moto(st.bucket, "run/step-00000005/")
    found = cleanup.plan(st)
    (c,) = found.garbage
    write(s3_url, 5)  # a job resumed and committed step 5 meanwhile
    assert cleanup.remove(st, c, found)
    (info,) = checkpoint.scan(st)
    assert info.complete
    checkpoint.verify(st, info)


def test_local_one_leftover_that_cannot_go_stops_nothing_else(tmp_path):
    write(str(tmp_path), 10)
    (tmp_path / "elsewhere").mkdir()
    stuck = tmp_path / "step-00000020"
    stuck.mkdir()
    (stuck / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # "empty", yet no rmdir
    for step in (30, 40):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / TEMP).write_bytes(b"x")
    age(tmp_path)
    out = sg("rm", str(tmp_path), "--incomplete")
    assert out.returncode == 2, out
    assert f"could not delete {tmp_path}/step-00000020/ (empty folder" in out.stdout, out.stdout
    assert out.stdout.count("deleted") == 2 and "1 of 3 could not be deleted" in out.stderr, out
    assert not (tmp_path / "step-00000030").exists() and not (tmp_path / "step-00000040").exists()
    assert (tmp_path / "elsewhere").is_dir() and checkpoint.scan(open_storage(str(tmp_path)))[0].complete


def test_s3_one_upload_that_cannot_be_aborted_stops_nothing_else(s3_url):
    st = open_storage(s3_url)
    client = boto3.client("s3")
    for key in ("run/step-00000020//state.pt", "run/step-00000030/state.pt"):
        client.create_multipart_upload(Bucket=st.bucket, Key=key)
    out = sg("rm", s3_url, "--incomplete", "--min-age", "0")
    assert out.returncode == 2, out
    assert f"could not delete {s3_url}/step-00000020//state.pt (multipart upload" in out.stdout, out.stdout
    assert f"deleted {s3_url}/step-00000030/state.pt (multipart upload" in out.stdout, out.stdout
    uploads = [u["Key"] for u in client.list_multipart_uploads(Bucket=st.bucket).get("Uploads", [])]
    assert uploads == ["run/step-00000020//state.pt"]


def test_a_newline_in_a_temp_files_owner_forges_no_line(tmp_path):
    (tmp_path / "step-00000007").mkdir()
    forged = "state.pt.tmp-h\ndeleted everything (temp file, 1 byte, 9.0 h old)@1-0123abcd"
    (tmp_path / "step-00000007" / forged).write_bytes(b"x")
    age(tmp_path)
    out = sg("rm", str(tmp_path), "--incomplete", "--dry-run")
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("would delete "), lines
    assert "state.pt.tmp-h\\ndeleted everything" in out.stdout
    assert Path(tmp_path / "step-00000007" / forged).exists()


def test_s3_a_folder_named_almost_like_a_step_never_supersedes_it(s3_url):
    st = open_storage(s3_url)
    write(s3_url, 4, 5)
    # (moto refuses a key with a newline: that alias is tested on local storage, tests/checkpoint/folders/test_names.py)
    for alias in ("step-000000005.r2", "step-0000000\u0665.r2", "step-00000005.r2x"):
        for name in ("state.pt", "manifest.json"):
            st.put_bytes(f"{alias}/{name}", st.get_bytes(f"step-00000005/{name}"))
    assert [i.name for i in checkpoint.scan(st)] == ["step-00000004", "step-00000005"]
    checkpoint.prune(st, keep=1)
    (info,) = checkpoint.scan(st)
    assert info.name == "step-00000005"
    checkpoint.verify(st, info)
