"""Probe for a device session (bench/gpu_session.sh; CUDA only, not a `make bench` script): ways to move a
warm checkpoint file's tensors to the GPU, each timed once with its GB/s (what checkpoint/state/upload.py
chose from: pinned buffers filled by pread on several threads)."""

import ctypes
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spotguard.checkpoint.format import digest  # noqa: E402

N, SIZE = 48, 64 << 20  # 48 x 64 MiB = 3.2 GB


def main() -> None:
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        path = Path(tmp) / "s.pt"
        torch.save({f"t{i}": torch.randn(SIZE // 4) for i in range(N)}, path)
        nbytes = N * SIZE
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
        gb = nbytes / 1e9

        def timed(label, fn):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            print(f"{label:55s} {s:7.3f} s {gb / s:6.1f} GB/s", flush=True)

        dst = {f"t{i}": torch.empty(SIZE // 4, device=dev) for i in range(N)}

        def pageable():
            sd = torch.load(path, mmap=True, weights_only=True)
            for k, v in sd.items():
                dst[k].copy_(v)

        def pageable_threads(n):
            def go():
                sd = torch.load(path, mmap=True, weights_only=True)
                with ThreadPoolExecutor(n) as ex:
                    list(ex.map(lambda kv: dst[kv[0]].copy_(kv[1]), sd.items()))

            return go

        def pinned(n, via_pread, chunk=32 << 20):
            def go():
                sd = torch.load(path, mmap=True, weights_only=True)
                local = threading.local()
                fd = os.open(path, os.O_RDONLY)
                items = list(sd.items())
                # file offsets through /proc/self/maps
                base = None
                ptr0 = items[0][1].data_ptr()
                for line in open("/proc/self/maps"):
                    parts = line.split()
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    if lo <= ptr0 < hi:
                        base = lo - int(parts[2], 16)
                        break

                def one(kv):
                    k, v = kv
                    if not hasattr(local, "bufs"):
                        local.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                        local.ev = [torch.cuda.Event(), torch.cuda.Event()]
                        local.s = torch.cuda.Stream()
                        local.i = 0
                    d = dst[k].view(torch.uint8)
                    total = v.numel() * v.element_size()
                    for off in range(0, total, chunk):
                        n_ = min(chunk, total - off)
                        b = local.i % 2
                        local.i += 1
                        local.ev[b].synchronize()
                        buf = local.bufs[b]
                        if via_pread:
                            mv = (ctypes.c_char * n_).from_address(buf.data_ptr())
                            os.preadv(fd, [mv], v.data_ptr() - base + off)
                        else:
                            ctypes.memmove(buf.data_ptr(), v.data_ptr() + off, n_)
                        with torch.cuda.stream(local.s):
                            d[off : off + n_].copy_(buf[:n_], non_blocking=True)
                            local.ev[b].record(local.s)
                    for e in local.ev:
                        e.synchronize()

                with ThreadPoolExecutor(n) as ex:
                    list(ex.map(one, items))
                os.close(fd)

            return go

        timed("torch.load(mmap) + copy_ pageable, 1 thread", pageable)
        timed("torch.load(mmap) + copy_ pageable, 8 threads", pageable_threads(8))
        for n in (4, 8, 12):
            timed(f"pinned ring memmove, {n} threads", pinned(n, False))
            timed(f"pinned ring pread, {n} threads", pinned(n, True))
        for n in (8, 16):
            t0 = time.perf_counter()
            digest.chunked_file_digest(path, threads=n, alg=digest.BLAKE3)
            s = time.perf_counter() - t0
            print(f"{'blake3 verify, ' + str(n) + ' threads':55s} {s:7.3f} s {gb / s:6.1f} GB/s", flush=True)
        ref = torch.load(path, mmap=True, weights_only=True)
        ok = all(torch.equal(ref[k], dst[k].cpu()) for k in ("t0", f"t{N - 1}"))
        print("exact:", ok)


if __name__ == "__main__":
    main()
