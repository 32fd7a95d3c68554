"""One periodic save of a ~192 MB state, printing how much the peak RSS grew during it (a test's worker).

argv: root, staging budget in bytes or "none". A fresh process, so the high-water mark is this save's.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

import spotguard


def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    root, budget = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(4 << 20)) for i in range(12)})
    g = spotguard.Guard(
        root,
        providers=[],
        every_steps=1,
        keep=2,
        save_on_exit=False,
        staging_budget=None if budget == "none" else int(budget),
    )
    g.track(model=model)
    g.resume()
    before = peak()
    with g:
        g.step(1)
        g.wait()
    st = g.stats()
    print(
        json.dumps(
            {
                "grew": peak() - before,
                "state": sum(p.numel() * 4 for p in model.values()),
                "budget": st.staging_budget,
                "staged": st.state_bytes,
                "checkpoints": st.checkpoints,
            }
        )
    )


if __name__ == "__main__":
    main()
