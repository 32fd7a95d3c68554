"""Cost of the first save's check that the state loads back with ``torch.load(weights_only=True)``.

Our figure: ``spotguard.checkpoint.state.loadable.check`` on a trained model's and AdamW's state (the
structure pickled with empty tensors, read back by torch's weights-only loader). Baselines, measured
in the same run: ``torch.save`` of the same state to a sink that drops the bytes (what checking by a
second serialisation would cost at least), and the other way to check, ``torch.save`` to a file
then ``torch.load(weights_only=True, mmap=True)`` of it. Paid once per Guard, at its first save.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _rows import emit, parser, row  # noqa: E402
from torch import nn  # noqa: E402

from spotguard.checkpoint.state import loadable  # noqa: E402

LAYERS, WIDTH, REPEAT = 400, 256, 5


class _Drop(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        return len(memoryview(b))


def state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def best(fn) -> float:
    times = []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    st = state()
    tensors = sum(1 for v in st["model"].values()) + sum(len(s) for s in st["optimizer"]["state"].values())
    size = sum(t.numel() * t.element_size() for t in st["model"].values()) * 3
    ours = best(lambda: loadable.check(st))
    save = best(lambda: torch.save(st, _Drop()))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.pt")

        def save_and_load() -> None:
            torch.save(st, path)
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)

        real = best(save_and_load)
    print(f"state: {tensors} tensors, {size / 1e6:.0f} MB")
    print(f"loadable.check (structure only):         {ours * 1e3:8.1f} ms")
    print(f"baseline: torch.save to a null sink:      {save * 1e3:8.1f} ms")
    print(f"torch.save to a file + weights_only load: {real * 1e3:8.1f} ms")
    print(f"ratio (ours / null-sink save):            {ours / save:8.2f}x")
    emit(
        [
            row(
                f"first-save weights_only check ({tensors} tensors, {size / 1e6:.0f} MB)",
                ours * 1e3,
                "ms",
                baseline=save * 1e3,
                baseline_label="torch.save of the same state to a null sink",
                target="ratio < 1",
                passed=lambda v, r: r is not None and r < 1,
            )
        ],
        args.json,
    )


if __name__ == "__main__":
    main()
