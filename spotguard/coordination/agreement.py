"""Process groups: every rank stops after the same step, and the earliest deadline governs.

Each rank watches its own notice sources (signal handlers on every rank, cloud metadata on local
rank 0 of each node by default). ``guard.step()`` then combines the local flags of all ranks with
one all-reduce of one integer (MAX) on a dedicated gloo group, every ``sync_every`` steps: a
separate group never interleaves with the training's NCCL collectives, nor with the save group
that synchronous sharded checkpoints (``spotguard.checkpoint.sharded.sharded``) coordinate on. Background
saves coordinate through the job's key-value store instead (``spotguard.checkpoint.sharded.sharded_async``):
no collective from a second thread, none that a destroyed group can leave blocked. Only when the verdict is "stop" is
a second, equally small all-reduce spent on the earliest deadline (MIN of UTC epoch seconds:
wall clocks, because monotonic clocks differ between machines). With ``deadline_policy="use-window"`` one
more (``agree_window``) says whether every rank trains on after the first emergency checkpoint; the
second stop is then voted on like the first. Settings the ranks must share for their votes to match
(the deadline policy) are compared once, when the agreement is made (``same``): one all-reduce, and a
``ConfigError`` on every rank instead of a collective that never completes.

Without an initialised process group nothing here runs: the single-process ``Guard`` pays for one
attribute check per step and no collective.
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import math
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from spotguard.coordination.ranks import is_distributed
from spotguard.errors import ConfigError, SpotguardError
from spotguard.notices.base import Notice

logger = logging.getLogger(__name__)

#: How long a background save waits for a peer's part (torch's default process-group timeout).
STORE_TIMEOUT_S = 1800.0

#: Verdicts, ordered so that MAX picks the most urgent one.
NOTHING, PERIODIC, ADVISORY, STOP = 0, 1, 2, 3

#: A setting every rank must share: its value as a number, and the names of the numbers for an enum (else None).
Settings = Mapping[str, tuple[float, Sequence[str] | None]]


def _epoch(deadline: dt.datetime | None) -> float:
    return deadline.timestamp() if deadline is not None else math.inf


def _job_store() -> Any:
    """The store the default process group rendezvoused through (torchrun's TCPStore), or None when
    background sharded saves should be synchronous: this torch does not expose it, or it is a
    ``FileStore`` (``init_method="file://"``), whose file only grows (a delete appends a tombstone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as e:  # a private helper: absent or changed in some torch version
        logger.warning("the process group's store is not reachable (%s): sharded saves are synchronous", e)
        return None
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.FileStore):
        logger.info("the process group rendezvoused through a file (FileStore): sharded saves are synchronous")
        return None
    if isinstance(base, dist.TCPStore):
        # A client of its own: one client serves one request at a time, so the writer's polls would
        # wait behind any blocking call of the loop's thread on the shared one (a new_group).
        try:
            return dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False)
        except Exception as e:  # the shared client then, with the same keys as the other ranks' own clients
            logger.info("a second client of the job's store failed (%s): the writer shares the loop's", e)
    return base


def _registered(group: Any) -> bool:
    """Whether ``group`` is still a live group of this process (not destroyed, default group up)."""
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):  # "not registered" / "default process group has not been initialized"
        return False
    return True


class Agreement:
    """The collective side of a ``Guard`` in a process group (one per Guard, built on every rank).

    Creating it is itself collective (two ``new_group`` calls, with ``async_save`` a broadcast of
    the name its background saves use in the store, with ``same`` one all-reduce that compares the
    settings every rank must share): every rank must construct its Guard in the same order. ``close()`` destroys the groups (``Guard.close`` calls it; an ``atexit`` hook
    does it for a Guard never closed).
    """

    def __init__(
        self, sync_every: int = 1, timeout: float | None = None, async_save: bool = False, same: Settings | None = None
    ) -> None:
        kwargs: dict[str, Any] = {"backend": "gloo"}
        if timeout is not None:
            kwargs["timeout"] = dt.timedelta(seconds=timeout)
        self.group: Any = dist.new_group(**kwargs)
        self.save_group: Any = dist.new_group(**kwargs)
        self.timeout_s = STORE_TIMEOUT_S if timeout is None else timeout
        self.store: Any = _job_store() if async_save else None
        self.uid = ""
        if self.store is not None:  # fresh per Guard and per job attempt: a restarted job's store holds old keys
            box = [f"spotguard/{uuid.uuid4().hex}"]
            dist.broadcast_object_list(box, src=0, group=self.group)
            self.uid = box[0]
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sync_every = sync_every
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._figures = torch.zeros(2, dtype=torch.int64)  # vote_poll's verdict and poll flag
        self._deadline = torch.zeros(1, dtype=torch.float64)
        _at_exit.add(self)
        if same:
            try:
                self.require_same(same)
            except ConfigError:
                self.close()
                raise

    def require_same(self, same: Settings) -> None:
        """Collective: ``ConfigError`` on every rank when any of ``same`` differs between ranks (one
        all-reduce of each value and its negation: the largest and the smallest)."""
        values = [float(v) for v, _ in same.values()]
        figures = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        n = len(values)
        for i, (name, (value, names)) in enumerate(same.items()):
            high, low = float(figures[i]), -float(figures[n + i])
            if high == low:
                continue

            def say(v: float, names: Sequence[str] | None = names) -> str:
                return repr(names[int(v)]) if names is not None else f"{v:g}"

            raise ConfigError(
                f"{name} differs between ranks ({say(low)} on some, {say(high)} on others; rank {self.rank} has "
                f"{say(value)}): every rank must stop and train on alike, so set the same {name} on every rank "
                "(the option, or the environment variable it falls back to)"
            )

    @property
    def usable(self) -> bool:
        """Both groups can still run collectives: not closed, and not destroyed by the user's
        ``dist.destroy_process_group()`` (which destroys every group, ours included)."""
        return self.group is not None and _registered(self.group) and _registered(self.save_group)

    def close(self) -> None:
        """Destroy the groups now, while the interpreter is whole. Idempotent, never raises.

        Why: ``dist.destroy_process_group()`` shuts groups down and forgets them, but a gloo group
        (two worker threads, a socket loop) lives on while anything holds it. Held here until
        interpreter shutdown, a worker that still had a tensor to release took the GIL while
        Python was finalizing, and the process aborted ("terminate called without an active
        exception"). Dropping the last references here joins those threads. Any order works: a
        group the user already destroyed (with the default group) is only released. The store
        stays: a background writer still ending (abandoned) polls it, and it is the job's.
        """
        groups, self.group, self.save_group = [self.group, self.save_group], None, None
        _at_exit.discard(self)
        for group in groups:
            if group is None or not _registered(group):
                continue
            try:
                dist.destroy_process_group(group)  # local: shuts the gloo backend down, unregisters it
            except Exception as e:
                logger.warning("destroying spotguard's process group failed: %s: %s", type(e).__name__, e)
        groups.clear()  # the last references: the C++ destructors join the groups' threads here

    def check(self) -> None:
        if self.group is None:
            raise SpotguardError(
                "this Guard is closed: its process groups are destroyed (enter it again with "
                "`with guard:` on every rank, or build a new Guard)"
            )

    def reduce(self, code: int, group: Any = None) -> int:
        """MAX of every rank's code (one all-reduce of one int64), on ``group`` or the agreement's.

        Safe from the background writer's thread (on its own group): only the per-step call
        reuses a preallocated tensor.
        """
        if group is None:
            self.check()
        flag = self._flag if group is None else torch.zeros(1, dtype=torch.int64)
        flag[0] = code
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group or self.group)
        return int(flag[0])

    def earliest_deadline(self, deadline: dt.datetime | None) -> dt.datetime | None:
        """The earliest notice deadline of all ranks (None when no rank has one)."""
        self._deadline[0] = _epoch(deadline)
        dist.all_reduce(self._deadline, op=dist.ReduceOp.MIN, group=self.group)
        earliest = float(self._deadline[0])
        return None if math.isinf(earliest) else dt.datetime.fromtimestamp(earliest, dt.timezone.utc)

    def agree_stop(self, step: int, notice: Notice | None) -> tuple[float | None, Notice | None]:
        """Collective, at the stop step: the seconds left before the earliest deadline of all ranks, and
        the notice this rank reports when only another rank saw one (None when it saw one itself)."""
        deadline = self.earliest_deadline(notice.deadline if notice else None)
        peer = (
            None
            if notice
            else Notice("peer", "preempt", deadline=deadline, raw={"step": step, "seen_by": "another rank"})
        )
        left = None if deadline is None else (deadline - dt.datetime.now(dt.timezone.utc)).total_seconds()
        return left, peer

    def agree_window(self, save_s: float, left: float) -> tuple[float, float]:
        """Collective, after the first emergency checkpoint with ``deadline_policy="use-window"``: the
        slowest rank's save time (inf: a rank wrote none it could measure) and the least time left to
        the deadline, the same on every rank, so that every rank opens the window or none does."""
        figures = torch.tensor([save_s, -left], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        return float(figures[0]), -float(figures[1])

    def vote(self, code: int) -> int:
        """The verdict of this sync step: MAX of every rank's code (``NOTHING`` .. ``STOP``)."""
        return self.reduce(code)

    def vote_poll(self, code: int, due: bool) -> tuple[int, bool]:
        """``vote`` that also says whether every rank polls its in-step notice sources now (any rank's
        clock found the interval gone: ``guard.insync``), in the same all-reduce of two int64s."""
        self.check()
        figures = self._figures
        figures[0], figures[1] = code, int(due)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        return int(figures[0]), bool(figures[1])

    def busy(self, in_flight: bool) -> bool:
        """Whether any rank's previous async save is still in flight: one rank decides for all."""
        return bool(self.reduce(int(in_flight)))

    def agree_inflight(self, decision: int) -> int:
        """The emergency's decision on an in-flight async save, the same on every rank (MAX: the most
        cautious). The ranks' parts are one collective save: one rank alone may not drop or keep it."""
        return self.reduce(decision)


#: Agreements not closed yet. At exit (before interpreter shutdown) they are closed, so a Guard
#: never closed (no ``with`` block, an exception that skipped ``close()``) leaves no gloo group
#: to the finalizer either. Weak: a Guard dropped by the program is not kept alive.
_at_exit: weakref.WeakSet[Agreement] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for agreement in list(_at_exit):
        agreement.close()


def setup(
    sync_every: int, timeout: float | None = None, async_save: bool = False, same: Settings | None = None
) -> Agreement | None:
    """An ``Agreement`` when a process group is initialised, else None (single process). ``same``: settings
    every rank must share (``Agreement.require_same``)."""
    if not is_distributed():
        return None
    agreement = Agreement(sync_every, timeout, async_save, same)
    logger.info(
        "rank %d/%d: agreeing on stops every %d step(s) on a dedicated gloo group",
        agreement.rank,
        agreement.world_size,
        sync_every,
    )
    return agreement
