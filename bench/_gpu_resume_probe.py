"""Where a cold resume's time goes on a GPU machine (run by bench/gpu_session.sh "resume"; not by make bench).

A real-size state (as bench/gpu_real_size.py builds it) saved once; then, each from a dropped page cache
unless named warm: the resume (the first of the process, as in bench/gpu_real_size.py), torch.load(mmap) +
load_state_dict, the checksum's walk alone and the resume with one or four chunks read in at once, plain
reads of the file (one thread, four threads). One line per figure; the device is named on the first.
"""

from __future__ import annotations

import logging
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
from spotguard.checkpoint.format import digest  # noqa: E402
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

        def readers(n: int, fn):
            def run() -> None:
                digest.READERS, before = n, digest.READERS
                try:
                    fn()
                finally:
                    digest.READERS = before

            return run

        cold(f"resume (READERS={digest.READERS}), first of the process", resume)
        cold("torch.load(mmap) + load_state_dict", baseline)
        for n in (1, 4):
            cold(f"walk (checksum alone), READERS={n}", readers(n, walk))
        cold("read, 1 thread, 16 MB", lambda: read_threads(state, 1))
        cold("read, 4 threads, 16 MB interleaved", lambda: read_threads(state, 4))
        for n in (1, 4):
            cold(f"resume, READERS={n}", readers(n, resume))
        cold("torch.load(mmap) + load_state_dict, again", baseline)
        rs.read_in(root)
        timed("walk (checksum alone), warm", walk)
        timed("resume, warm", resume)
        timed("resume, warm again", resume)
        timed("torch.load(mmap) + load_state_dict, warm", baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
