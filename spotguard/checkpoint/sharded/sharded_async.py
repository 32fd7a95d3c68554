"""Sharded saves written in the background, the ranks coordinated through the job's key-value store.

Why not collectives on a process group: a writer thread blocked in a gloo collective cannot be
woken. When the program destroyed its process group inside the ``with guard:`` block, or a peer
never reached the collective, the thread waited out gloo's timeout and aborted the process at
exit. The store torch.distributed rendezvoused through (torchrun's TCPStore) outlives every
group, and every wait here is a poll that also watches the save's cancel event and a timeout:
the writer always ends, on every rank. DCP's own steps run as in ``dcp.save`` (plan, global
plan, write, finish on the coordinator), with plans and write results passed through the store;
the plans are agreed on the loop's thread when the save is staged (``sharded_plan``).

Keys, under ``<agreement>/<seq>/`` (``seq`` counts staged saves; every rank stages the same ones):

- ``plan/R``: rank R's DCP plan (or why it has none), published when it staged (``sharded_plan``);
- ``gplan/R``: rank 0's global plan, rank R's part, likewise: a rank stages only the items it writes;
- ``prep``: rank 0 checked the step is not committed and cleared leftovers of an interrupted save;
- ``done/R``: rank R's files written: its file entries, DCP write results and its own work seconds;
- ``outcome``: rank 0 committed the manifest (its bytes, and the slowest rank's work), or why it did not;
- ``left``: a counter of ranks done with the save, whatever its end; the last one forgets its keys
  (never a timer: a rank whose store client is busy reads late, and must still find the outcome).
  After a commit, rank 0 keeps the store up (it may live in its process) until the others left.

A rank that stops early (error, cancel) publishes its status under every key it still owes, so no
rank waits for it. Values are pickled, as ``all_gather_object`` would: they travel between the
ranks of one job, never to storage.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from spotguard.checkpoint.files.fileio import WorkMeter
from spotguard.checkpoint.files.stream import Ring
from spotguard.checkpoint.format.manifest import FileEntry
from spotguard.checkpoint.sharded.dcp import SpotguardWriter
from spotguard.errors import SaveCancelled, StorageError
from spotguard.storage.base import Storage

OK, FAILED, CANCELLED, EXISTS = "ok", "failed", "cancelled", "exists"
#: Longest sleep between two polls of a key: each wait ends at most this long after the key lands
#: (a store round trip costs ~0.1 ms; a blocking store.wait() would hold the client and log on timeout).
POLL_MAX_S = 0.01
READ_GRACE_S = 10.0  # how long rank 0 keeps its process (the store) up for the others to read the outcome


class Stopped(Exception):
    """This rank stops the save: ``status`` is FAILED (with the reason), CANCELLED or EXISTS."""

    def __init__(self, status: str, reason: str = "") -> None:
        super().__init__(reason or status)
        self.status, self.reason = status, reason


@dataclasses.dataclass
class Exchange:
    """One save's keys in the store, seen from one rank."""

    store: Any
    prefix: str
    rank: int
    world: int
    cancel: threading.Event
    timeout: float

    def put(self, key: str, status: str, value: Any = None) -> None:
        self.store.set(self.prefix + key, pickle.dumps((status, value)))

    def get(self, key: str, cancellable: bool = True) -> Any:
        """The value published under ``key`` once it is there; raises ``Stopped`` for a failure or cancel
        there, a cancel of this rank's save (unless not ``cancellable``) or the timeout."""
        full, start, delay = self.prefix + key, time.monotonic(), 0.001
        while not self.store.check([full]):
            if cancellable and self.cancel.is_set():
                raise Stopped(CANCELLED)
            if time.monotonic() - start > self.timeout:
                raise Stopped(FAILED, f"rank {self.rank}: no {key!r} from its peer within {self.timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        status, value = pickle.loads(self.store.get(full))
        if status != OK:
            raise Stopped(status, value or "")
        return value

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise Stopped(CANCELLED)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(self.prefix + key)
            except Exception:  # a store without delete (older FileStore): the keys are small
                pass


def write(
    ex: Exchange,
    storage: Storage,
    step: int,
    where: str,
    planned: tuple[SavePlan | None, SavePlanner, Metadata | None],
    prepare: Callable[[], str],
    write_rank_file: Callable[[], tuple[str, list[FileEntry]]],
    commit: Callable[[list[FileEntry]], bytes],
    meter: WorkMeter | None = None,
    ring: Ring | None = None,
) -> tuple[bytes, float | None] | None:
    """This rank's part of a background sharded save of ``step`` into ``where`` (its directory); every rank
    calls it for the same save.

    ``planned``: this rank's final DCP plan, a planner that resolves its (staged) items, and on rank 0
    DCP's metadata, all agreed when the save was staged (``sharded_plan``). ``prepare()`` (rank 0:
    "ok", "exists" or a failure), ``write_rank_file()`` (-> error, entries) and ``commit(files)``
    (rank 0: the manifest bytes) are the sharded engine's, shared with its synchronous saves.
    ``ring``: where live device tensors pass on their way to the files (the items are not staged).
    ``meter``: this rank's files' own work (``DirectFile.work_seconds``, counted by ``write_rank_file``
    and the shard's writer alike). Returns the committed manifest's bytes and the slowest rank's work
    (None where a rank did not measure it), None when the step is already committed; raises
    ``StorageError`` or ``SaveCancelled`` on every rank alike.
    """
    rank, world = ex.rank, ex.world
    owed = ["prep", "outcome"] if rank == 0 else [f"done/{rank}"]
    try:
        if rank == 0:
            status = prepare()
            ex.put("prep", OK if status == OK else EXISTS if status == EXISTS else FAILED, status)
            owed.remove("prep")
            if status != OK:
                raise Stopped(EXISTS if status == EXISTS else FAILED, status)
        else:
            ex.get("prep")
        ex.check_cancel()
        error, entries = write_rank_file()
        if error:
            raise Stopped(FAILED, error)
        plan, planner, metadata = planned
        if plan is None:  # never: a rank without a plan carries its reason into write_rank_file
            raise Stopped(FAILED, f"rank {rank}: no plan")
        writer = SpotguardWriter(storage, where, rank, cancel=ex.cancel, meter=meter, ring=ring)
        writer.set_up_storage_writer(rank == 0)
        results = writer.write_data(plan, planner).value()
        entries.extend(writer.entries)
        work_s = meter.seconds if meter is not None else None
        if rank != 0:
            ex.put(f"done/{rank}", OK, ([dataclasses.astuple(e) for e in entries], results, work_s))
            owed.remove(f"done/{rank}")
            return ex.get("outcome", cancellable=False)  # rank 0 decides, promptly: it has every report
        done = [ex.get(f"done/{r}") for r in range(1, world)]
        if metadata is None:  # never: rank 0 made the global plan when it staged
            raise Stopped(FAILED, "rank 0: no global plan")
        writer.finish(metadata, [results] + [res for _, res, _ in done])
        entries.append(writer.entries[-1])  # the metadata file finish() wrote
        files = entries + [FileEntry(*e) for es, _, _ in done for e in es]
        works = [work_s] + [w for _, _, w in done]
        slowest = None if any(w is None for w in works) else max(w for w in works if w is not None)
        ex.check_cancel()  # the last moment an abandoned save can still be dropped
        manifest = commit(sorted(files, key=lambda f: f.name))
        ex.put("outcome", OK, (manifest, slowest))
        owed.remove("outcome")
        _await_readers(ex)
        return manifest, slowest
    except Stopped as e:
        _settle(ex, owed, e)
        if e.status == EXISTS:
            return None
        if e.status == CANCELLED:
            raise SaveCancelled(f"sharded save of step {step} abandoned before its commit") from None
        raise StorageError(f"sharded checkpoint of step {step} not committed: {e.reason}") from None
    except Exception as e:
        reason = f"rank {rank}: {type(e).__name__}: {e}"
        _settle(ex, owed, Stopped(CANCELLED if isinstance(e, SaveCancelled) else FAILED, reason))
        if isinstance(e, SaveCancelled):
            raise
        raise StorageError(f"sharded checkpoint of step {step} not committed: {reason}") from e
    finally:
        _leave(ex)


def _settle(ex: Exchange, owed: list[str], stop: Stopped) -> None:
    """Publish ``stop`` under every key this rank still owes, so that no peer waits for it."""
    for key in owed:
        try:
            ex.put(key, stop.status, stop.reason)
        except Exception:  # the store itself is gone: the peers' waits end with their own errors
            return


def _await_readers(ex: Exchange) -> None:
    """Rank 0, after the commit: keep the store up (it may live in this process) until every other
    rank read the outcome, or ``READ_GRACE_S``: a rank that reads later still finds it."""
    start = time.monotonic()
    while ex.store.add(ex.prefix + "left", 0) < ex.world - 1 and time.monotonic() - start < READ_GRACE_S:
        time.sleep(0.002)


def _leave(ex: Exchange) -> None:
    """This rank is done with the save's keys; the last rank to leave forgets them all."""
    try:
        if ex.store.add(ex.prefix + "left", 1) < ex.world:
            return
    except Exception:  # the store is gone (rank 0's process exited): nothing to forget
        return
    keys = ["prep", "outcome", "left"] + [f"{k}/{r}" for r in range(ex.world) for k in ("plan", "gplan", "done")]
    ex.forget(keys)
