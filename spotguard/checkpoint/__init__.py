"""Checkpoints: what one is (``manifest``), how it is laid out in storage (``layout``), what a
training state is (``state``, ``data``, ``snapshot``), and the engines that write and read one.

The names below are the public face of checkpoints in a storage (``spotguard ls`` and ``verify``
use them too); the engines (``single``, ``sharded``) import torch.distributed and are not loaded here.
"""

from spotguard.checkpoint.filewrite import Writer
from spotguard.checkpoint.layout import copy, write, write_dir
from spotguard.checkpoint.manifest import (
    FORMAT,
    FORMATS,
    MANIFEST,
    REASONS,
    CheckpointInfo,
    FileEntry,
    HashingWriter,
    Manifest,
    human_duration,
    parse_step_dir,
    step_dir,
)
from spotguard.checkpoint.reader import fetch, latest, open_verified, scan, verify
from spotguard.checkpoint.retention import delete, prune

__all__ = [
    "FORMAT",
    "FORMATS",
    "MANIFEST",
    "REASONS",
    "CheckpointInfo",
    "FileEntry",
    "HashingWriter",
    "Manifest",
    "Writer",
    "copy",
    "delete",
    "fetch",
    "human_duration",
    "latest",
    "open_verified",
    "parse_step_dir",
    "prune",
    "scan",
    "step_dir",
    "verify",
    "write",
    "write_dir",
]
