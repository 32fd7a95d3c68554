"""Build locks a killed attempt left in torch's JIT extension folder, cleared before a restart.

Why: torch builds (or, every start, checks) a JIT extension under a lock file in
``$TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions`` by default): every DeepSpeed job on CPU loads
its shared-memory op that way. An attempt killed while it held the lock leaves the file behind, and
the restarted job then waits for it forever: a crash turned into a hang, and the hang's restart into
another. torch's builder keeps its lock file open while it holds it, so a lock no process has open is
a leftover. Linux only (``/proc``); elsewhere nothing is cleared.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
PROC = Path("/proc")


def folder() -> Path:
    """Where torch builds its JIT extensions (torch's own rule, without importing torch)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def clear_stale(root: Path | None = None) -> list[Path]:
    """Remove the build locks under ``root`` (default ``folder()``) no process holds; the ones removed."""
    root = root or folder()
    locks = [*root.glob("*/lock"), *root.glob("*/*/lock")]
    if not locks or not PROC.is_dir():
        return []
    held = _open_files()
    removed = []
    for lock in locks:
        with contextlib.suppress(OSError):
            if lock.resolve() not in held:
                lock.unlink()
                removed.append(lock)
                logger.warning("removed %s, a build lock no process holds (left by a killed attempt)", lock)
    return removed


def _open_files() -> set[Path]:
    """Every file some process has open (those /proc lets this user see)."""
    out: set[Path] = set()
    for fd in PROC.glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            out.add(Path(os.readlink(fd)))
    return out
