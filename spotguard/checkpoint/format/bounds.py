"""Sane ranges for what a manifest may say, checked before anything acts on it.

Why: a manifest is read from storage that others can write, and every reader (``ls``, ``verify``,
``pull``, resume) trusts its numbers. Deeply nested JSON raised ``RecursionError`` out of them; a
``chunk_size`` of 10**18 made verification allocate that many bytes (``MemoryError``); a
``world_size`` of 10**18 made resume refuse instead of falling back. Anything outside these ranges
makes the checkpoint corrupt (``Manifest.from_bytes`` turns the ``ValueError`` into
``CheckpointCorruptError``), so resume skips it for an older one and ``ls``/``verify`` report it.

In order: ``load_json`` bounds the bytes, the nesting (the parser's own recursion and a walk of the
result) and returns the document; ``check_manifest`` bounds its counts and numbers. Writers call
``check_written`` so that they never commit a manifest that readers would refuse.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BYTES = 64 << 20  # a manifest of MAX_FILES entries is ~40 MB
MAX_DEPTH = 64  # the manifest itself nests 3 deep; the rest is for guard.extra
MAX_FILES = 200_000
MAX_STEP = 2**53  # what every JSON reader holds exactly
MAX_FILE_SIZE = 1 << 50  # 1 PiB
MAX_WORLD_SIZE = 1 << 20
# Digest chunks (0: a whole-file SHA-256, spotguard/1). Verification holds up to ~10 chunks in memory.
CHUNK_MIN, CHUNK_MAX = 1 << 20, 64 << 20


def load_json(raw: bytes) -> Any:
    """``raw`` parsed, if it is at most ``MAX_BYTES`` and ``MAX_DEPTH`` deep; else ``ValueError``."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"{len(raw)} bytes, more than {MAX_BYTES}")
    try:
        doc = json.loads(raw)
    except RecursionError as e:
        raise ValueError(f"nested more than {MAX_DEPTH} deep") from e
    check_depth(doc)
    return doc


def check_depth(doc: Any) -> None:
    """``ValueError`` when lists and objects nest more than ``MAX_DEPTH`` deep (walked without recursion)."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} deep")
        stack.extend((child, depth + 1) for child in children)


def _integer(value: Any, what: str, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{what} {str(value)[:40]} is not an integer in [{low}, {high}]")


def check_manifest(doc: dict[str, Any]) -> None:
    """``ValueError`` when a manifest's counts or numbers are out of range (types are checked by the caller)."""
    files = doc.get("files")
    if isinstance(files, list) and len(files) > MAX_FILES:
        raise ValueError(f"{len(files)} files listed, more than {MAX_FILES}")
    if "step" in doc:
        _integer(doc["step"], "step", 0, MAX_STEP)
    _integer(doc.get("world_size", 1), "world_size", 1, MAX_WORLD_SIZE)
    for entry in files if isinstance(files, list) else ():
        if not isinstance(entry, dict):
            continue
        name = str(entry.get("name"))[:80]
        if "size" in entry:
            _integer(entry["size"], f"size of {name!r}:", 0, MAX_FILE_SIZE)
        chunk = entry.get("chunk_size", 0)
        if chunk != 0 or isinstance(chunk, bool):
            _integer(chunk, f"chunk_size of {name!r}:", CHUNK_MIN, CHUNK_MAX)
        digest = entry.get("digest")  # spotguard/3: {"alg", "chunk", "value"}
        if isinstance(digest, dict) and "chunk" in digest:
            _integer(digest["chunk"], f"digest chunk of {name!r}:", CHUNK_MIN, CHUNK_MAX)


def check_written(raw: bytes, doc: dict[str, Any]) -> None:
    """What a writer is about to commit, checked as a reader will: ``ValueError`` naming the limit."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"the manifest would be {len(raw)} bytes, more than {MAX_BYTES} (guard.extra too large?)")
    try:
        check_depth(doc)
    except ValueError as e:
        raise ValueError(f"the manifest would be {e} (guard.extra nested too deep?)") from e
    check_manifest(doc)
