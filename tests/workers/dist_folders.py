"""Worker for tests/checkpoint/folders/test_folders.py (2 plain processes, gloo): trainer folders committed
across ranks that share no folder, and fetched back per node.

Each rank writes its own folder: a file both ranks have (the same bytes, as a model every rank saves
would be) and a file of its own. Cases, reported with ``emit`` as ``{case, kind, ...}``:
``commit`` (one checkpoint with every rank's files), ``failing-rank`` (rank 1 holds a file no
checkpoint may hold: every rank raises, nothing committed), ``fetch`` (the newest is corrupt on disk:
every rank skips it and gets step 1's files, from the one copy the node's local rank 0 fetched into
the shared ``work_dir``), ``per-node`` (each rank a node of its own, fetching by a rule: the shared
file and its own; the corrupt file is rank 1's, seen by node 1 alone, and both still skip step 2),
``planned`` (Lightning's resume: the copy of step 2 named before the fetch gets step 1's files),
``resharded`` (a checkpoint of 4 ranks: every node fetches every file), ``none-loads`` (every
checkpoint corrupt: every rank raises), ``supersede`` (a committed step written again as its next
revision, in another storage: the fetch takes the new one).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from spotguard.checkpoint import scan, write_dir
from spotguard.checkpoint.folders import folders
from spotguard.checkpoint.folders.pernode import RankFiles
from spotguard.checkpoint.format.reader import CORRUPT_MARK
from spotguard.coordination import agreement
from spotguard.errors import ConfigError, NoLoadableCheckpointError
from spotguard.integrations._common import FolderCheckpoints
from spotguard.integrations._planned_resume import PlannedResume
from spotguard.storage import LocalStorage
from tests.workers.results import emit


def write_folder(folder: Path, rank: int, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shared.bin").write_bytes(bytes([step]) * 100)
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / f"own-{rank}.bin").write_bytes(bytes([rank, step]) * 10)
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def unmark(root: str, rank: int, out: str, case: str) -> None:
    """Rank 0 says whether the fetch marked step 2 corrupt (``reader.mark_corrupt``), and removes the mark:
    the next case verifies step 2's files again rather than skip it from the listing."""
    dist.barrier()
    if rank == 0:
        mark = Path(root) / "step-00000002" / CORRUPT_MARK
        emit(out, case=f"marked-after-{case}", marked=mark.exists())
        mark.unlink(missing_ok=True)
    dist.barrier()


def main(root: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = agreement.setup(sync_every=1)
    assert groups is not None
    storage = LocalStorage(root)
    local = Path(out) / f"local-{rank}"

    for step in (1, 2):
        manifest = folders.commit(
            storage, groups, step, write_folder(local / f"s{step}", rank, step), reason="periodic"
        )
        emit(out, case="commit", step=step, files=sorted(f.name for f in manifest.files), world=manifest.world_size)

    # Step 1 again, superseding (an evaluation's cut state): beside it as step-00000001.r1 (rank 0 picks
    # the name for all), which the fetch then takes.
    other = LocalStorage(root + "-supersede")
    folders.commit(other, groups, 1, write_folder(local / "o1", rank, 1), reason="periodic")
    folders.commit(other, groups, 1, write_folder(local / "o1b", rank, 11), reason="emergency", supersede=True)
    found = folders.fetch(other, groups, work_dir=str(Path(out) / "work-supersede"))
    assert found is not None
    names = [i.name for i in scan(other)]
    emit(out, case="supersede", step=found[0], names=names, shared=(found[1] / "shared.bin").read_bytes()[0])

    bad = write_folder(local / "s3", rank, 3)
    if rank == 1:
        (bad / "manifest.json").write_text("{}")  # a name no checkpoint file may have
    try:
        folders.commit(storage, groups, 3, bad, reason="periodic")
        emit(out, case="failing-rank", kind="ok")
    except ConfigError as e:
        emit(out, case="failing-rank", kind=type(e).__name__, message=str(e))

    dist.barrier()
    if rank == 0:  # step 2's own file of rank 1 flipped on the durable storage
        stored = Path(root) / "step-00000002" / "sub" / "own-1.bin"
        data = bytearray(stored.read_bytes())
        data[0] ^= 0xFF
        stored.unlink()
        stored.write_bytes(bytes(data))
    dist.barrier()
    found = folders.fetch(storage, groups, work_dir=str(Path(out) / "work"))
    assert found is not None
    step, folder = found
    emit(out, case="fetch", step=step, files=listing(folder), shared=(folder / "shared.bin").read_bytes()[0])
    unmark(root, rank, out, "fetch")

    # Each rank a node of its own, with its own folder, fetching by a rule (``sub/own-<rank>.bin`` is
    # that rank's own file): step 2's corrupt file is rank 1's, seen by node 1 alone, and both skip it.
    os.environ["LOCAL_RANK"] = "0"
    rule = RankFiles(lambda name: int(name[8]) if name.startswith("sub/own-") else None)
    found = folders.fetch(storage, groups, work_dir=str(Path(out) / f"work-{rank}"), rank_files=rule)
    assert found is not None
    emit(out, case="per-node", step=found[0], files=listing(found[1]))
    unmark(root, rank, out, "per-node")
    # Lightning's planned resume: step 2's copy named before the group was up; step 2 does not verify,
    # so step 1 is moved there (every rank agrees on step 1).
    checkpoints = FolderCheckpoints(storage, work_dir=str(Path(out) / f"work-{rank}"), lease_ttl=None)
    planned = PlannedResume(checkpoints, rule)
    where = folders.node_folder(storage, 2, checkpoints.work_dir)
    planned.step, planned.planned = 2, where  # as plan() names it before the group is up
    planned.fetch()
    emit(out, case="planned", step=planned.step, files=listing(where), shared=(where / "shared.bin").read_bytes()[0])
    checkpoints.loaded()
    emit(out, case="planned-removed", gone=not where.exists())
    checkpoints.group.close()
    if rank == 0:  # a checkpoint written by 4 ranks: every node fetches every file
        write_folder(local / "s4", 0, 4)
        write_dir(storage, 4, write_folder(local / "s4", 1, 4), reason="periodic", world_size=4)
    dist.barrier()
    found = folders.fetch(storage, groups, work_dir=str(Path(out) / f"work-{rank}"), rank_files=rule)
    assert found is not None
    emit(out, case="resharded", step=found[0], files=listing(found[1]))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(root) / "step-00000004")
    os.environ["LOCAL_RANK"] = str(rank)

    dist.barrier()
    if rank == 0:
        stored = Path(root) / "step-00000001" / "shared.bin"
        stored.unlink()
        stored.write_bytes(b"\0" * 100)
    dist.barrier()
    try:
        folders.fetch(storage, groups, work_dir=str(Path(out) / "work"))
        emit(out, case="none-loads", kind="ok")
    except NoLoadableCheckpointError as e:
        emit(out, case="none-loads", kind=type(e).__name__, skipped=len(e.skipped))
    groups.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
