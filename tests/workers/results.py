"""How a worker rank reports to its test: JSON lines in a file of its own, ``DIR/results-<rank>.jsonl``.

Ranks under torchrun share one stdout, where the lines of two ranks can interleave (a print() writes
text and newline apart, and a write over PIPE_BUF bytes is not atomic); a file per rank cannot.
The test reads them back with ``tests.helpers.worker_results``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def emit(out_dir: str | Path, **record: Any) -> None:
    """Append ``record`` (with this process's rank) to its results file."""
    rank = int(os.environ.get("RANK", "0"))
    with open(Path(out_dir) / f"results-{rank}.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, **record}) + "\n")
