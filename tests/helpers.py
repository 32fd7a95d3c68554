"""Helpers for tests: subprocess environments, free ports, and running the example training script."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train.py"
#: SPOTGUARD_* variables children keep (the metadata endpoint tests point at a closed port or a mock).
KEEP_ENV = ("SPOTGUARD_AZURE_METADATA_ENDPOINT",)
_CLOSED: socket.socket | None = None


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this checkout first on the path, no stray notice config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_") or k in KEEP_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def block_cloud_metadata() -> None:
    """Point every metadata endpoint variable at a bound, never-listening 127.0.0.1 port (refused at once)."""
    global _CLOSED
    if _CLOSED is None:
        _CLOSED = socket.socket()
        _CLOSED.bind(("127.0.0.1", 0))  # held for the session, never listen(): connections are refused
    port = _CLOSED.getsockname()[1]
    os.environ.update({"AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{port}",
                       "GCE_METADATA_HOST": f"127.0.0.1:{port}", "GCE_METADATA_IP": f"127.0.0.1:{port}",
                       "SPOTGUARD_AZURE_METADATA_ENDPOINT": f"http://127.0.0.1:{port}"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_cmd(storage: str | Path, *args: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--storage", str(storage), "--quiet", *args]


def run_example(storage: str | Path, *args: str, env: dict[str, str] | None = None,
                timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(example_cmd(storage, *args), env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def read_losses(path: Path) -> list[tuple[int, float]]:
    """(step, loss) pairs in the order they were logged; losses are exact (float.hex)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append((rec["step"], float.fromhex(rec["loss"])))
    return out


def chunked_sha256(data: bytes, chunk: int = 16 << 20) -> str:
    """What a spotguard/2 manifest records for a file: SHA-256 of its chunks' SHA-256 digests."""
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] or [b""]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
