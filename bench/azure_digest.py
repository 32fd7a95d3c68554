"""What the per-block digests Azure checks on upload cost: the digest per GiB, and uploads to Azurite.

Run from the repository root: ``python bench/azure_digest.py [--size-mb 256] [--reps 3]``. It
starts Azurite (``tests/azurite``) in memory on 127.0.0.1 and stops it.

Figures, each measured in this same run:
- the digest's cost, seconds of one core per GiB: MD5 (hashlib), Azure's CRC64 through awscrt's
  ``crc64nvme`` (what the ``azure`` extra installs) and through the SDK's own helper
  (``azure-storage-extensions``, when installed; it needs ``bytes`` and holds the GIL), and the
  CRC32 every upload already keeps for the download check.
- uploads of one ``--size-mb`` file to Azurite (8 blocks of 16 MiB in flight), MB/s and the client
  process's CPU seconds per GiB: spotguard's ``put_file`` with the writer's digests (CRC64, then
  MD5), against the SDK's own parallel ``upload_blob(validate_content=True)``, which is what
  spotguard sent before (a Content-MD5 per block, computed from the bytes read for the upload).

Azurite computes its CRC64 check in JavaScript, ~40-50 MB/s per block on this 2-core machine (its MD5
is native): on loopback the CRC64 rows measure the emulator's check, not the client; Azure
verifies natively. The client CPU rows are what the digest costs the training machine.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _rows import emit, parser, row  # noqa: E402
from storage import AZURITE, AZURITE_KEY, MB, free_port, start, stop  # noqa: E402

from spotguard.storage._common import file_crc  # noqa: E402
from spotguard.storage.azure import AzureOptions, AzureStorage  # noqa: E402

GiB = 1 << 30


def per_gib(fn, data: bytes, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Least seconds of ``fn(data)`` over ``reps`` tries, scaled to one GiB."""
    best = min(_time(lambda: fn(data)) for _ in range(reps))
    return best * GiB / len(data)


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def digest_rows(reps: int) -> list[dict]:
    data = os.urandom(256 << 20)
    block = 16 << 20
    costs = {"MD5 (hashlib)": lambda d: [hashlib.md5(d[o : o + block]).digest() for o in range(0, len(d), block)]}
    try:
        from awscrt.checksums import crc64nvme

        costs["CRC64 (awscrt crc64nvme)"] = lambda d: [crc64nvme(d[o : o + block]) for o in range(0, len(d), block)]
    except ImportError:
        print("awscrt is not installed: no awscrt CRC64 row", flush=True)
    try:
        from azure.storage.extensions import checksums  # type: ignore[import-not-found]

        costs["CRC64 (azure-storage-extensions)"] = lambda d: [
            checksums.crc64.compute(bytes(d[o : o + block]), 0) for o in range(0, len(d), block)
        ]
    except ImportError:
        print("azure-storage-extensions is not installed: no row for the SDK's CRC64 helper", flush=True)
    costs["CRC32 (zlib, kept for downloads)"] = lambda d: zlib.crc32(d)
    view = memoryview(data)
    return [
        row(f"digest cost, {name}", round(per_gib(fn, view, reps), 3), "s/GiB", target="info only")
        for name, fn in costs.items()
    ]


def upload_rows(size_mb: int, reps: int) -> list[dict]:
    from azure.storage.blob import BlobServiceClient

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="spotguard-bench-") as work:
        proc = start(
            [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"]
            + ["--disableTelemetry", "--skipApiVersionCheck", "--loose", "--silent"],
            port,
            work,
        )
        try:
            conn = (
                f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
            )
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = conn
            path = Path(work) / "state.pt"
            path.write_bytes(os.urandom(size_mb * 1_000_000))
            size = path.stat().st_size
            service = BlobServiceClient.from_connection_string(
                conn, max_block_size=16 << 20, max_single_put_size=16 << 20
            )
            blob = service.create_container("bench").get_blob_client("sdk/state.pt")

            def sdk() -> None:
                with open(path, "rb") as f:
                    blob.upload_blob(f, overwrite=True, max_concurrency=8, validate_content=True)

            runs = {"the SDK's upload_blob(validate_content=True) (before)": sdk}
            for kind in ("crc64", "md5"):
                st = AzureStorage(f"az://bench/{kind}", AzureOptions(block_checksum=kind))
                sums = file_crc(path, st.upload_crc)  # kept by the writer while it wrote the file: not timed
                runs[f"spotguard put_file, writer's {kind.upper()}"] = lambda st=st, sums=sums: st.put_file(
                    "state.pt", path, crc=sums
                )
            results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
            for _ in range(reps):  # interleaved: load on the machine hits every variant alike
                for name, fn in runs.items():
                    cpu, wall = time.process_time(), time.perf_counter()
                    fn()
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    results[name][0].append(size / MB / wall)
                    results[name][1].append(cpu * GiB / size)
            service.close()
        finally:
            stop(proc)
    base_name = next(iter(runs))
    base_speed, base_cpu = (statistics.median(v) for v in results[base_name])
    rows = []
    for name, (speeds, cpus) in results.items():
        label = f"{size / MB:.0f} MB to Azurite (loopback)"
        rows.append(
            row(
                f"upload {label}, {name}",
                round(statistics.median(speeds), 1),
                "MB/s",
                baseline=round(base_speed, 1),
                baseline_label=base_name,
                target="info only",
            )
        )
        rows.append(
            row(
                f"client CPU of that upload, {name}",
                round(statistics.median(cpus), 2),
                "s/GiB",
                baseline=round(base_cpu, 2),
                baseline_label=base_name,
                target="<= the SDK's upload",
                passed=lambda v, ratio: ratio is not None and ratio <= 1.0,
            )
        )
    return rows


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256, help="file size in MB (default 256)")
    p.add_argument("--reps", type=int, default=3, help="tries of each variant; the median is reported")
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs", flush=True)
    emit(digest_rows(args.reps) + upload_rows(args.size_mb, args.reps), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
