"""Where a cold resume's time goes on a GPU machine (run by bench/gpu_session.sh "resume"; not by make bench).

A real-size state (as bench/gpu_real_size.py builds it) saved once; then, each from a dropped page cache
unless named warm: the checksum's walk alone, plain reads of the file (one thread, four threads), the walk
with readahead asked for ahead of it, the resume as it is, and torch.load(mmap) + load_state_dict. One line
per figure; the device is named on the first.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_real_size as rs  # noqa: E402

import spotguard  # noqa: E402
from spotguard import checkpoint  # noqa: E402
from spotguard.checkpoint.format import digest, verifying  # noqa: E402
from spotguard.storage import open_storage  # noqa: E402

CHUNK = 16 << 20


def timed(label: str, fn) -> float:
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    print(f"{label:48s} {took:7.3f} s", flush=True)
    return took


def read_threads(path: Path, threads: int) -> None:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)

    def part(k: int) -> None:
        buf = bytearray(CHUNK)
        for off in range(k * CHUNK, size, threads * CHUNK):
            os.preadv(fd, [buf], off)

    try:
        ts = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        os.close(fd)


def lookahead(ahead: int):
    real = digest._read_in

    def read_in(mm: mmap.mmap, start: int, length: int) -> bool:
        nxt = start + length
        end = min(len(mm), nxt + ahead)
        if end > nxt:
            begin = nxt - nxt % mmap.PAGESIZE
            mm.madvise(mmap.MADV_WILLNEED, begin, end - begin)
        return real(mm, start, length)

    return read_in


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    logging.getLogger("spotguard.checkpoint.state.upload").setLevel(logging.DEBUG)
    with tempfile.TemporaryDirectory(prefix="sg-probe-") as tmp:
        root = Path(tmp)
        size_gb = float(os.environ.get("PROBE_GB", "0") or 0) or rs.default_size_gb(dev, root)
        model, opt = rs.build(size_gb, dev)
        rs.step(model, opt, dev)
        print(f"state: {size_gb:.2f} GB on {rs.device_name(dev)}", flush=True)
        g = spotguard.Guard(str(root / "ckpt"), providers=[], save_on_exit=False)
        g.track(model=model, optimizer=opt)
        g.save(1)
        g.close()
        plain = root / "plain.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain)
        del model, opt, g
        state = next((root / "ckpt").rglob("state.pt"))
        info = checkpoint.latest(open_storage(str(root / "ckpt")))
        entry = next(f for f in info.manifest.files if f.name == "state.pt")  # type: ignore[union-attr]
        fresh, fresh_opt = rs.build(size_gb, dev)

        def walk() -> None:
            digest.file_digest(state, entry.chunk_size, entry.alg)

        def resume() -> None:
            g2 = spotguard.Guard(str(root / "ckpt"), providers=[], save_on_exit=False)
            g2.track(model=fresh, optimizer=fresh_opt)
            g2.resume()
            rs.sync(dev)
            g2.close()

        def baseline() -> None:
            sd = torch.load(plain, map_location="cpu", weights_only=True, mmap=True)
            fresh.load_state_dict(sd["model"])
            fresh_opt.load_state_dict(sd["optimizer"])
            rs.sync(dev)

        def cold(label: str, fn) -> None:
            rs.drop_cache(root)
            timed(label + ", cold", fn)

        cold("walk (checksum alone)", walk)
        cold("read, 1 thread, 16 MB", lambda: read_threads(state, 1))
        cold("read, 4 threads, 16 MB interleaved", lambda: read_threads(state, 4))
        for ahead in (64 << 20, 256 << 20):
            digest._read_in, real = lookahead(ahead), digest._read_in
            cold(f"walk, WILLNEED {ahead >> 20} MB ahead", walk)
            digest._read_in = real
        cold("resume (as is)", resume)
        digest._read_in, real = lookahead(256 << 20), digest._read_in
        cold("resume, walk WILLNEED 256 MB ahead", resume)
        digest._read_in = real
        real_wait = verifying.Verifying.wait_read
        verifying.Verifying.wait_read = lambda self, end: None  # type: ignore[method-assign]
        cold("resume, upload not gated by the walk", resume)
        verifying.Verifying.wait_read = real_wait  # type: ignore[method-assign]
        cold("torch.load(mmap) + load_state_dict", baseline)
        rs.read_in(root)
        timed("walk (checksum alone), warm", walk)
        timed("resume (as is), warm", resume)
        timed("resume (as is), warm again", resume)
        verifying.Verifying.wait_read = lambda self, end: None  # type: ignore[method-assign]
        timed("resume, upload not gated, warm", resume)
        verifying.Verifying.wait_read = real_wait  # type: ignore[method-assign]
        timed("torch.load(mmap) + load_state_dict, warm", baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
