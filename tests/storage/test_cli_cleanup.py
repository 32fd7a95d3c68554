"""``spotguard rm --incomplete`` deletes only old garbage of spotguard's own names, and ``ls`` counts the hidden
leftovers: on a local folder, S3 (moto server) and GCS (fake-gcs-server), the CLI run as a process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import boto3
import pytest

from spotguard import checkpoint
from spotguard.checkpoint.lease import LEASE, LeaseRecord
from spotguard.storage import open_storage
from tests.helpers import example_cmd, subprocess_env

OLD = 2 * 3600.0  # seconds: past the default --min-age of 1 h


def sg(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args],
        env=subprocess_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(url: str, *steps: int) -> None:
    st = open_storage(url)
    for step in steps:
        checkpoint.write(st, step, {"state.pt": lambda f, s=step: f.write(bytes([s]) * 5000)}, reason="periodic")


def hold_lease(url: str) -> None:
    """A live lease record, as a running Guard keeps it (renewed just now)."""
    now = time.time()
    record = LeaseRecord("run-a", socket.gethostname(), os.getpid(), acquired_at=now - 600, renewed_at=now, ttl_s=120)
    open_storage(url).put_bytes(LEASE, record.to_bytes())


def age(path: Path, seconds: float = OLD) -> None:
    """Set back the modification time of ``path`` and everything below it."""
    then = time.time() - seconds
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (then, then), follow_symlinks=False)


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize("guard", ["age", "lease"])
def test_a_save_in_flight_keeps_its_scratch_temp_files_and_stored_files(guard, tmp_path):
    """A real LocalStorage save stopped half-way: scratch folder, temp file being written, one file stored."""
    root = tmp_path / "ckpt"
    write(str(root), 10)
    st = open_storage(str(root))
    argv = ["rm", str(root), "--incomplete"]
    if guard == "lease":  # old enough by the threshold: only the lease keeps them
        hold_lease(str(root))
        argv += ["--min-age", "0"]
    with st.scratch() as scratch, st.open_write("step-00000020/state.pt") as f:
        (scratch / "0-state.pt").write_bytes(b"s" * 1000)
        f.write(b"half of a state file")
        st.put_bytes("step-00000020/rank1.pt", b"stored already, the manifest not yet")
        before = tree(root)
        out = sg(*argv)
        assert out.returncode == 0, out.stderr
        assert tree(root) == before
        assert "deleted" not in out.stdout
        assert out.stdout.count("skipped") == 3, out.stdout  # step-00000020, its temp file, the scratch folder
        why = "live lease (run run-a on host" if guard == "lease" else "less than the minimum age 1 h"
        assert out.stdout.count(why) == 3, out.stdout
    assert (root / "step-00000020" / "state.pt").read_bytes() == b"half of a state file"  # the write went on


def test_old_garbage_goes_and_names_spotguard_never_writes_stay(tmp_path):
    root = tmp_path / "ckpt"
    write(str(root), 10)
    ours = {
        ".spotguard.tmp-deadhost@4242-ab12cd34/0-state.pt": b"scratch of a killed save",
        "step-00000030/state.pt": b"stored before the kill",
        "step-00000030/shards/rank1.pt.tmp-deadhost@4242-0123abcd": b"temp file of a killed write",
        "step-00000040/state.pt.tmp-deadhost@4242-89abcdef": b"the only file of a killed save",
    }
    foreign = {
        "notes.tmp-1": b"another program's",
        "cache.tmp-x/data.bin": b"a folder with .tmp- in its name",
        "exp.tmp-run/step-00000001/state.pt": b"nested",
        "other/a.pt.tmp-deadhost@4242-0123abcd": b"our pattern, outside a checkpoint folder",
        ".spotguard.tmp-readme": b"a file, not a scratch folder",
    }
    for name, data in {**ours, **foreign}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "step-00000050").mkdir()  # an empty checkpoint folder
    age(root)
    out = sg("rm", str(root), "--incomplete")
    assert out.returncode == 0, out.stderr
    assert "skipped" not in out.stdout and out.stdout.count("deleted") == 5, out.stdout
    assert tree(root) == sorted(
        {
            *(p for name in foreign for p in _parents(name)),
            "step-00000010",
            "step-00000010/manifest.json",
            "step-00000010/state.pt",
        }
    )
    assert [i.step for i in checkpoint.scan(open_storage(str(root)))] == [10]


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


@pytest.mark.parametrize("url", ["", "file://", " "])
def test_an_empty_path_is_refused(url, tmp_path):
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "state.pt").write_bytes(b"x")
    (tmp_path / "state.pt.tmp-deadhost@4242-0123abcd").write_bytes(b"x")
    age(tmp_path)
    before = tree(tmp_path)
    out = sg("rm", url, "--incomplete", "--min-age", "0", cwd=tmp_path)
    assert out.returncode == 1 and "names no folder (it would mean the current directory)" in out.stderr
    assert tree(tmp_path) == before


def test_a_lease_record_that_cannot_be_read_stops_rm(tmp_path):
    root = tmp_path / "ckpt"
    write(str(root), 10)
    (root / "step-00000020").mkdir()
    (root / "step-00000020" / "state.pt").write_bytes(b"killed save")
    (root / LEASE).write_text("{not json")
    age(root)
    out = sg("rm", str(root), "--incomplete")
    assert out.returncode == 1 and "nothing deleted (delete spotguard-lease.json if no job writes here)" in out.stderr
    assert (root / "step-00000020" / "state.pt").exists()


def _uploads(client, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def backdate_in_moto(bucket: str, prefix: str) -> None:
    """Make the objects and upload parts under ``prefix`` 2 h older inside moto, as if written then."""
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    store = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_bucket(bucket)
    shift = timedelta(seconds=OLD)
    for key in store.keys.values():
        if key.name.startswith(prefix):
            key.last_modified -= shift
    for upload in store.multiparts.values():
        if upload.key_name.startswith(prefix):
            for part in upload.parts.values():
                part.last_modified -= shift


def test_s3_young_objects_and_live_uploads_stay_old_ones_go(s3_url):
    st = open_storage(s3_url)
    client = boto3.client("s3")
    write(s3_url, 10)
    for step, size in ((30, 1000), (40, 2000)):
        key = f"run/step-{step:08d}/state.pt"
        upload = client.create_multipart_upload(Bucket=st.bucket, Key=key)
        client.upload_part(Bucket=st.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * size)
    st.put_bytes("step-00000030/rank1.pt", b"killed save")
    st.put_bytes("step-00000050/rank1.pt", b"in flight: its manifest comes next")
    backdate_in_moto(st.bucket, "run/step-00000030/")
    out = sg("ls", s3_url)
    assert "hidden: 2 unfinished multipart uploads, 3.0 kB;" in out.stdout, out.stdout
    out = sg("rm", s3_url, "--incomplete")
    assert out.returncode == 0, out.stderr
    assert f"deleted {s3_url}/step-00000030 (incomplete: no manifest, 2.0 h old)" in out.stdout, out.stdout
    assert f"deleted {s3_url}/step-00000030/state.pt (multipart upload, 1.0 kB, 2.0 h old)" in out.stdout
    assert f"skipped {s3_url}/step-00000040/state.pt (multipart upload, 2.0 kB," in out.stdout
    assert f"skipped {s3_url}/step-00000050 (incomplete: no manifest," in out.stdout
    assert out.stdout.count("skipped") == 2 and out.stdout.count("deleted") == 2, out.stdout
    assert _uploads(client, st.bucket) == ["run/step-00000040/state.pt"]
    assert [(i.step, i.status) for i in checkpoint.scan(st)] == [(10, "complete"), (50, "incomplete")]
    hold_lease(s3_url)  # a live run: not even --min-age 0 touches it
    out = sg("rm", s3_url, "--incomplete", "--min-age", "0")
    assert out.returncode == 0 and "deleted" not in out.stdout and out.stdout.count("live lease") == 2, out.stdout
    assert _uploads(client, st.bucket) == ["run/step-00000040/state.pt"]


def test_s3_bucket_root_keeps_other_applications_uploads(s3_url):
    bucket = open_storage(s3_url).bucket
    client = boto3.client("s3")
    for key in ("step-00000040/state.pt", "other-app/big.bin", "backup.tmp-1", "step-notes/x", "run/step-00000001/a"):
        client.create_multipart_upload(Bucket=bucket, Key=key)
    out = sg("rm", f"s3://{bucket}", "--incomplete", "--min-age", "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("deleted") == 1, out.stdout
    assert f"deleted s3://{bucket}/step-00000040/state.pt (multipart upload" in out.stdout
    assert _uploads(client, bucket) == ["backup.tmp-1", "other-app/big.bin", "run/step-00000001/a", "step-notes/x"]


def test_s3_a_manifest_naming_a_missing_file_is_removed_when_old(s3_url):
    """The in-flight object deleted under a save that then committed: corrupt for good."""
    write(s3_url, 10, 20, 30)
    st = open_storage(s3_url)
    st.delete(["step-00000030/state.pt"])
    out = sg("rm", s3_url, "--incomplete")
    assert "skipped" in out.stdout and "broken: step-00000030: missing file(s) state.pt" in out.stdout, out.stdout
    backdate_in_moto(st.bucket, "run/step-00000030/")
    out = sg("rm", s3_url, "--incomplete")
    assert out.returncode == 0 and f"deleted {s3_url}/step-00000030 (broken" in out.stdout, out.stdout
    assert [(i.step, i.status) for i in checkpoint.scan(st)] == [(10, "complete"), (20, "complete")]


_KILLED_UPLOAD = """
import os, signal, sys
from spotguard.storage.gcs import GCSOptions, GCSStorage
st = GCSStorage(sys.argv[1], GCSOptions(chunk_size=256 * 1024, composite_threshold=512 * 1024, concurrency=2))
done = []
def progress(n):
    done.append(n)
    if len(done) == 3:  # three parts stored, the rest in flight: the machine goes
        os.kill(os.getpid(), signal.SIGKILL)
st.progress = progress
with st.open_write("step-00000020/state.pt") as f:
    f.write(os.urandom(8 * 256 * 1024))
"""


def test_gcs_parts_of_a_killed_composite_upload_are_shown_by_ls_and_removed(fake_gcs_url):
    write(fake_gcs_url, 10)
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_UPLOAD, fake_gcs_url], env=subprocess_env(), capture_output=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    st = open_storage(fake_gcs_url)
    parts = [b for b in st.bucket.list_blobs() if ".sg-part-" in b.name]
    assert len(parts) >= 3
    size = sum(b.size for b in parts)
    shown = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
    out = sg("ls", fake_gcs_url)
    assert f"hidden: {len(parts)} unfinished upload parts, {shown};" in out.stdout, out.stdout
    assert "`spotguard rm --incomplete` removes them" in out.stdout
    out = sg("rm", fake_gcs_url, "--incomplete")  # just killed: too young to tell from a live upload
    assert "deleted" not in out.stdout and out.stdout.count("skipped") == len(parts), out.stdout
    out = sg("rm", fake_gcs_url, "--incomplete", "--min-age", "0")
    assert out.returncode == 0 and out.stdout.count("(upload part, 262.1 kB") == len(parts), out.stdout
    assert not [b for b in st.bucket.list_blobs() if ".sg-part-" in b.name]
    assert "hidden" not in sg("ls", fake_gcs_url).stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("min_age", [None, "0"])
def test_rm_in_a_loop_beside_a_running_training_job_deletes_nothing_of_it(tmp_path, capsys, min_age):
    """examples/train.py saving at every step while ``rm --incomplete`` runs again and again (in this process,
    through the CLI's ``main``: thousands of tries land inside its saves). Every save must commit. With
    ``--min-age 0`` nothing is too young to delete: only the job's writer lease protects its saves."""
    from spotguard.ops.cli import main

    age = ["--min-age", min_age] if min_age else []
    spared_by_lease = 0

    root = tmp_path / "ckpt"
    job = subprocess.Popen(
        [*example_cmd(root, "--steps", "25", "--every-steps", "1", "--num-workers", "0", "--providers", "signal")],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tries = 0
    try:
        while not root.exists() and job.poll() is None:  # before, rm says the path does not exist (exit 1)
            time.sleep(0.01)
        while job.poll() is None:
            assert main(["rm", str(root), "--incomplete", *age]) == 0
            tries += 1
            out = capsys.readouterr().out
            assert "deleted" not in out, out
            spared_by_lease += "the run holds a live lease" in out
            time.sleep(0.02)  # leave the job most of the CPU
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err[-3000:]
    assert tries > 10 and "Traceback" not in err and "failed" not in err, err[-3000:]
    infos = checkpoint.scan(open_storage(str(root)))
    assert infos[-1].step == 25 and all(i.complete for i in infos), infos
    if min_age == "0":
        assert spared_by_lease > 0, "no try met a save in flight under the lease"
