"""Worker for tests/guard/test_distributed.py (run by torchrun): examples/train_ddp.py on a checkpoint of
another world size, in one launch: first as is (refused on every rank, each prints ``rank <r> refused:
<message>``), then with ``--reshard reset-data``. Arguments: the example's, without ``--reshard``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_ddp  # noqa: E402

from spotguard import CheckpointMismatchError  # noqa: E402


def main() -> int:
    dist.init_process_group("gloo")
    try:
        train_ddp.main([*sys.argv[1:], "--reshard", "refuse"])
    except CheckpointMismatchError as e:
        sys.stdout.write(f"rank {dist.get_rank()} refused: {e}\n")  # one write: the ranks share stdout
        sys.stdout.flush()
    else:
        return 1
    return train_ddp.main([*sys.argv[1:], "--reshard", "reset-data"])


if __name__ == "__main__":
    sys.exit(main())
