"""Whose local tier a folder is: a fast first tier serves one run's durable storage, never another's.

A ``local_dir`` is often set once for every job of a machine (``$SPOTGUARD_LOCAL_DIR``, ``spotguard run
--local-dir /nvme/ckpt``). Checkpoints carry no run identity, so a job with a new durable storage would
otherwise resume another run's newest local checkpoint, silently, and write that state into its own
storage. The first job to use a folder as its tier leaves ``spotguard-tier.json`` there naming its durable
storage; a job of another storage leaves the folder alone and runs without a local tier, saying why. A
folder without the mark that holds checkpoints (a tier of an older spotguard) is claimed only when each of
them is also in the durable storage: then it is this run's.
"""

from __future__ import annotations

import json
import logging

from spotguard.checkpoint.format.reader import scan
from spotguard.errors import CheckpointExistsError
from spotguard.storage import Storage, open_storage
from spotguard.storage.base import ObjectNotFoundError

logger = logging.getLogger(__name__)

TIER_MARK = "spotguard-tier.json"


def identity(durable: Storage) -> str:
    """The durable storage a tier serves, as one string: a resolved path for local disk, else its URL."""
    root = getattr(durable, "root", None)
    return str(root.resolve()) if root is not None else durable.url.rstrip("/")


def _foreign(local: Storage, durable: Storage) -> list[int]:
    """The steps of checkpoints in an unmarked ``local`` that ``durable`` lacks (another run's, or unknown).
    An empty folder (a new tier: the common case) costs no listing of ``durable``."""
    held = [i for i in scan(local) if i.complete]
    mine = {i.name for i in scan(durable)} if held else set()
    return sorted(i.step for i in held if i.name not in mine)


def owner(local: Storage) -> str | None:
    """The durable storage ``local`` is the tier of; None when unclaimed. Unreadable: an owner of its own."""
    try:
        data = local.get_bytes(TIER_MARK)
    except ObjectNotFoundError:
        return None
    try:
        return str(json.loads(data)["durable"])
    except (ValueError, KeyError, TypeError):
        return f"(unreadable {local.describe(TIER_MARK)})"


def claim(local: Storage, durable: Storage) -> bool:
    """True when ``local`` may be ``durable``'s local tier (claimed now if no run had claimed it); False,
    with a WARNING, when it is another run's. A tier that cannot be read or claimed is not used either."""
    want = identity(durable)
    try:
        found = owner(local)
        if found is None:
            foreign = _foreign(local, durable)
            if foreign:
                found = f"unmarked, with checkpoints of steps {foreign[:5]} that are not in {want}"
            else:
                try:
                    local.put_bytes(TIER_MARK, json.dumps({"durable": want}).encode(), exclusive=True)
                    return True
                except CheckpointExistsError:  # another rank or job claimed it just now
                    found = owner(local)
    except OSError as e:  # StorageError, or the disk's own (full, read-only): no tier, and the job goes on
        logger.warning("not using the local tier %s: %s", local.describe(), e)
        return False
    if found == want:
        return True
    logger.warning(
        "not using the local tier %s: it holds the checkpoints of another run (%s), not of %s; give each run "
        "a local_dir ($SPOTGUARD_LOCAL_DIR, `spotguard run --local-dir`) of its own, or empty this one",
        local.describe(),
        found,
        want,
    )
    return False


def open_tier(local_dir: str | None, durable: Storage) -> Storage | None:
    """``local_dir`` as ``durable``'s local tier, or None (none given, or another run's: ``claim``)."""
    if not local_dir:
        return None
    local = open_storage(local_dir)
    return local if claim(local, durable) else None
