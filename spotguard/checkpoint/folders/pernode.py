"""Which files of a trainer's checkpoint one node fetches for a resume: the shared ones and its own ranks'.

A trainer in a process group writes, beside the state every rank loads (the weights, a replicated
optimizer, counters), files that one rank alone reads back: its RNG streams (HF's
``rng_state_N.pth``), its data position, its ZeRO optimizer partition. A node that fetches only its
own ranks' files downloads and verifies none of the others'. Each integration names its per-rank
files with a ``RankFiles`` rule, a pure function of the file name; a name the rule does not claim is
shared and fetched by every node, so a rule that misses a name costs bytes, never a file.

Every file is fetched when the checkpoint was written by another number of ranks than this job has
(its state is resharded, or refused by the loader with a message, and either may read any file), or
when any rank's integration is unsure of its rule (``RankFiles.unsure``: e.g. DeepSpeed's elastic
checkpoint, where every rank reads every partition). The number of ranks per node does not matter:
every per-rank name carries the global rank that reads it, so each node fetches the files of the
ranks it hosts now, whichever node wrote them.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from spotguard.errors import ConfigError


@dataclass(frozen=True)
class RankFiles:
    """An integration's rule for its checkpoint folder: ``rank_of(name)`` is the global rank that alone
    reads the file ``name`` (a relative posix path), None for a file any rank may read. ``unsure``:
    why this job cannot trust the rule (every file is then fetched), "" when it can."""

    rank_of: Callable[[str], int | None]
    unsure: str = ""


def why_everything(saved_world: int, world: int, unsure: Iterable[str]) -> str:
    """Why every node must fetch every file ("" when a node may leave other ranks' own files out):
    ``saved_world`` ranks wrote the checkpoint, ``world`` resume it, ``unsure`` holds each rank's doubt."""
    if saved_world != world:
        return f"the checkpoint was written by {saved_world} ranks and this job has {world} (resharding)"
    return "; ".join(sorted({u for u in unsure if u}))


def needed(names: Iterable[str], rank_of: Callable[[str], int | None], ranks: Collection[int], world: int) -> list[str]:
    """The ``names`` a node hosting ``ranks`` (of ``world``) needs: all but the other ranks' own files.
    A name the rule gives a rank outside the job is kept: the rule does not know it."""
    keep = []
    for name in names:
        rank = rank_of(name)
        if rank is None or rank in ranks or not 0 <= rank < world:
            keep.append(name)
    return keep


def private_folder(work_dir: str | None) -> Path:
    """This user's folder for the nodes' verified copies: ``spotguard-<uid>`` below ``work_dir`` (the
    system's temp folder), mode 0700, created when missing.

    Every rank of a node must find its node's copy by name before the ranks can talk, so the copy's
    name is predictable: on a machine shared with other users (multi-user Slurm nodes) another user
    could plant it, or a link to their own folder, and swap the verified files before a trainer
    unpickles them. Below a folder only this user can enter, they cannot; one that is a link, another
    user's, or open to others is refused (``ConfigError``).
    """
    base = Path(work_dir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)  # a work_dir not there yet
    parent = base / f"spotguard-{os.geteuid()}"
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    why = _not_private(os.lstat(parent))
    if why:
        raise ConfigError(
            f"{parent} is {why}, not this user's private folder: a checkpoint fetched into it could be swapped "
            "before it is loaded. Remove it, or give another work_dir"
        )
    return parent


def _not_private(st: os.stat_result) -> str:
    """Why a folder with ``st`` (``lstat``) is not this user's private folder, or ""."""
    if stat.S_ISLNK(st.st_mode):
        return "a link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"open to others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""
