"""Holding a run's writer lease: acquire, renew from a heartbeat, fence every commit, release.

Two jobs on one storage URL (a relaunch while the old machine still runs, a copy-pasted config)
would otherwise mix one run's history. Order of use, by the ``Guard``:

1. ``acquire()`` before anything is loaded or written: create ``spotguard-lease.json`` if absent
   (``Storage.put_conditional`` with no token); a record that is released, left by a dead process
   this one can see (same host and pid namespace), or this process's own is taken over at once with
   replace-if-unchanged. One that looks expired by this machine's clock, or renewed in its future, is
   watched: taken over only once it stayed unchanged for its ``ttl_s`` on this process's monotonic
   clock, refused if it changes meanwhile (the holder's clock, not its heartbeat, was off). A live
   one raises ``LeaseHeldError`` naming its holder, unless ``takeover`` is set; so does one of a
   newer format. Clock skew between machines thus never lets a live lease be taken over.
2. A daemon thread renews the record every ``ttl_s / 3`` with replace-if-unchanged. A renewal that
   meets another writer's record means the lease was taken over: it is lost (``on_lost`` is called).
3. ``fence()`` before every manifest write: one renewal, synchronously. A writer that lost its lease
   raises ``LeaseLostError`` and commits nothing; one that still holds it has ``ttl_s`` more seconds
   in which nobody may take it over (short of an explicit takeover, which then waits
   ``takeover_grace`` so that a manifest fenced just before lands ahead of its resume).
4. ``release()`` at a clean exit and after a committed emergency save: the record stays, marked
   released, so the replacement machine takes it over at once instead of waiting for the TTL.

The holder hands ``fence`` to the writers of its run (``layout.write(fence=)``, the engines'
``fence=``), which call it just before each manifest write; a writer given no fence is not fenced:
nothing here keeps a table of which storage is leased.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable

from spotguard import _env
from spotguard.checkpoint.lease import LEASE, LeaseRecord, NewerLeaseError, pid_namespace
from spotguard.errors import (
    CheckpointCorruptError,
    LeaseHeldError,
    LeaseLostError,
    PreconditionFailedError,
    StorageError,
)
from spotguard.storage.base import ObjectNotFoundError, Storage

logger = logging.getLogger(__name__)

_WATCH = "watch"  # _why_free: expired by the holder's timestamps only, which may be off: watch the record
_TWO_WRITERS = (
    "Two writers would mix one run's checkpoints: stop that job, use another storage URL, or take the run over "
    f"on purpose (Guard(takeover=True), ${_env.TAKEOVER}=1 or `spotguard run --takeover`)"
)

DEFAULT_TTL_S = 60.0
#: The longest a holder may still land a manifest after its fence: half its lease, at most this.
FENCE_BOUND_S = 20.0
#: A request sent just before that deadline may still land: its timeout (at least ``urgent_timeout``, 5 s).
IN_FLIGHT_S = 5.0


def fence_bound(ttl_s: float) -> float:
    """Seconds after its fence by which a ``ttl_s`` lease's holder must have landed its manifest (half the lease)."""
    return min(ttl_s / 2, FENCE_BOUND_S)


def takeover_grace(other: LeaseRecord | None) -> float:
    """After taking a live lease over on purpose: how long a manifest the other job fenced just before may
    take to land, so that this job's resume, which follows, sees it and never commits beside it."""
    return fence_bound(other.ttl_s if other is not None else DEFAULT_TTL_S) + IN_FLIGHT_S


def _visible(record: LeaseRecord) -> bool:
    """Whether ``record.pid`` names a process this one can see: the record says it was written in this
    host's, and this process's, pid namespace. Another container on this host may share the hostname,
    never its pids: there a pid this process cannot see may well be running."""
    return bool(record.pidns) and record.pidns == _PIDNS and record.host == socket.gethostname()


def _pid_gone(record: LeaseRecord) -> bool:
    """A record left by a process of this host and pid namespace that no longer runs (killed: it could not release)."""
    if not _visible(record) or record.pid == os.getpid():
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


_PIDNS = pid_namespace()


class Lease:
    """This process's hold on the writer lease of ``storage`` (module docstring for the order)."""

    def __init__(
        self,
        storage: Storage,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        takeover: bool = False,
        run_id: str | None = None,
        on_lost: Callable[[str], None] | None = None,
        alive: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        takeover_grace_s: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.storage, self.ttl_s, self.takeover = storage, float(ttl_s), takeover
        self.takeover_grace_s = takeover_grace_s
        self.owner = secrets.token_hex(8)
        self.run_id = run_id or self.owner
        #: ``alive()`` False (its Guard was garbage-collected unclosed): the heartbeat releases the lease.
        self.on_lost, self.alive, self.clock = on_lost, alive, clock
        #: Watching another's record: this process's own clock, and how it waits between two reads.
        self.monotonic, self.sleep = monotonic, sleep
        self.record: LeaseRecord | None = None
        #: Why the lease was lost (the new holder), or None while held or never taken.
        self.lost: str | None = None
        self.released = False
        self._token: str | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._at_exit = False

    @property
    def held(self) -> bool:
        return self.record is not None and self.lost is None and not self.released

    def acquire(self) -> LeaseRecord:
        """Take the lease (step 1); raise ``LeaseHeldError`` naming the live holder. Idempotent."""
        with self._lock:
            if self.held:
                return self.record  # type: ignore[return-value]
            now = self.clock()
            mine = LeaseRecord(
                self.run_id, socket.gethostname(), os.getpid(), now, now, self.ttl_s, owner=self.owner, pidns=_PIDNS
            )
            token = self._claim(mine)
            self.record, self._token, self.lost, self.released = mine, token, None, False
            self._stop = threading.Event()
        if not self._at_exit:  # released at interpreter exit if the program left it held (a Guard never closed)
            self._at_exit = True
            atexit.register(_release_at_exit, weakref.ref(self))
        self._thread = threading.Thread(target=self._beat, name="spotguard-lease", daemon=True)
        self._thread.start()
        return mine

    def _claim(self, mine: LeaseRecord) -> str:
        where = self.storage.describe(LEASE)
        watch: tuple[str, float] | None = None  # the other's record under watch: (token, since: our monotonic)
        races = 0
        while races < 5:  # each retry follows another writer's change: a race, not a loop
            try:
                return self.storage.put_conditional(LEASE, mine.to_bytes(), token=None)
            except PreconditionFailedError:
                pass
            try:
                data, token = self.storage.get_versioned(LEASE)
            except ObjectNotFoundError:
                races += 1
                continue  # deleted meanwhile (`spotguard rm`): create it again
            other, why = self._judge(data, self.clock())
            if why == _WATCH:
                assert other is not None
                if watch is not None and watch[0] != token:  # renewed while we watched: live
                    raise LeaseHeldError(self._renewed_message(other), other)
                if watch is None:
                    watch = (token, self.monotonic())
                    logger.info(
                        "writer lease of %s: %s, expired by this machine's clock only; watching it for %.3g s "
                        "(its TTL): taken over if it stays unchanged, refused if it is renewed",
                        self.storage.describe(),
                        other.describe(self.clock()),
                        other.ttl_s,
                    )
                waited = self.monotonic() - watch[1]
                if waited < other.ttl_s:
                    self.sleep(min(max(other.ttl_s / 10, 0.05), 2.0, other.ttl_s - waited))
                    continue
                why = f"not renewed for {waited:.3g} s, its TTL, by this machine's own clock"
            if other is not None:
                logger.log(
                    logging.WARNING if why == "taken over on purpose" else logging.INFO,
                    "writer lease of %s: %s (%s); taking it over",
                    self.storage.describe(),
                    other.describe(self.clock()),
                    why,
                )
            try:
                new = self.storage.put_conditional(LEASE, mine.to_bytes(), token=token)
            except PreconditionFailedError:
                races += 1
                continue  # another writer changed it between our read and our write: look again
            if why == "taken over on purpose":  # its last fenced commit lands before our resume reads
                grace = takeover_grace(other) if self.takeover_grace_s is None else self.takeover_grace_s
                if grace:
                    logger.warning(
                        "writer lease of %s taken: waiting %.0f s for a commit the other job began to land",
                        self.storage.describe(),
                        grace,
                    )
                self.sleep(grace)
            return new
        raise LeaseHeldError(f"cannot take the writer lease {where}: other writers keep changing it")

    def _judge(self, data: bytes, now: float) -> tuple[LeaseRecord | None, str]:
        """The record in ``data`` and why it may be taken over now, or ``_WATCH`` (see ``_claim``);
        raises ``LeaseHeldError`` while another writer holds it."""
        try:
            other = LeaseRecord.from_bytes(data)
        except NewerLeaseError as e:
            if self.takeover:
                logger.warning("writer lease of %s: %s; taking it over on purpose", self.storage.describe(), e)
                return None, "taken over on purpose"
            raise LeaseHeldError(
                f"{self.storage.describe()}: {e}. This version cannot judge whether that job still writes: stop "
                "it and upgrade spotguard here, or take the run over on purpose (Guard(takeover=True), "
                f"${_env.TAKEOVER}=1 or `spotguard run --takeover`)",
                e.holder,
            ) from e
        except CheckpointCorruptError as e:
            logger.warning("%s is not a lease record (%s): taking it over", self.storage.describe(LEASE), e)
            return None, "corrupt"
        why = self._why_free(other, now)
        if why is None:
            raise LeaseHeldError(self._held_message(other, now), other)
        return other, why

    def _why_free(self, other: LeaseRecord, now: float) -> str | None:
        """Why ``other`` may be taken over at once, ``_WATCH`` when only watching it can tell, or None
        while it is another writer's live lease."""
        if other.released:
            return "released"
        if other.owner == self.owner:
            return "our own"
        if _visible(other) and other.pid == os.getpid():
            return "an earlier writer of this process that was never closed"
        if _pid_gone(other):
            return "its process on this host is gone"
        if self.takeover:
            return "taken over on purpose"
        if other.from_the_future(now) or not other.live(now):
            return _WATCH  # by the holder's timestamps only: its clock may be off, so watch it
        return None

    def _held_message(self, other: LeaseRecord, now: float) -> str:
        return (
            f"another job is writing to {self.storage.describe()}: {other.describe(now)}; its lease expires in "
            f"{max(other.expires_at() - now, 0):.0f} s unless renewed. {_TWO_WRITERS}"
        )

    def _renewed_message(self, other: LeaseRecord) -> str:
        return (
            f"another job is writing to {self.storage.describe()}: {other.describe(self.clock())}; it renewed its "
            f"lease while this job watched (its clock and this machine's disagree). {_TWO_WRITERS}"
        )

    def _beat(self) -> None:
        """The heartbeat thread: renew every ttl/3 until released or lost; storage faults are retried."""
        stop = self._stop
        while not stop.wait(self.ttl_s / 3):
            if self.alive is not None and not self.alive():
                self.release()  # its writer is gone without a close: nobody commits under it any more
                return
            try:
                self.renew()
            except LeaseLostError:
                return
            except StorageError as e:
                logger.warning("cannot renew the writer lease of %s: %s", self.storage.describe(), e)

    def renew(self, released: bool = False) -> None:
        """Rewrite our record (replace-if-unchanged); raise ``LeaseLostError`` if it is no longer ours."""
        with self._lock:
            if self.lost is not None:
                raise LeaseLostError(self.lost)
            if self.record is None or self.released:
                raise LeaseLostError(
                    f"this job {'released' if self.released else 'holds no'} writer lease of "
                    f"{self.storage.describe()}: it commits nothing more"
                )
            update = dataclasses.replace(self.record, renewed_at=self.clock(), released=released)
            try:
                self._token = self.storage.put_conditional(LEASE, update.to_bytes(), token=self._token)
            except PreconditionFailedError:
                self._token = self._still_ours(loud=not released)
                self._token = self.storage.put_conditional(LEASE, update.to_bytes(), token=self._token)
            self.record = update

    def _still_ours(self, loud: bool = True) -> str:
        """After a refused renewal: the token of our record when it is still ours (a write whose reply
        was lost), else the lease is lost (``LeaseLostError``)."""
        gone = "its record was deleted"
        try:
            data, token = self.storage.get_versioned(LEASE)
            other: LeaseRecord | None = LeaseRecord.from_bytes(data)
        except ObjectNotFoundError:
            other = None
        except (CheckpointCorruptError, NewerLeaseError) as e:
            other, gone = None, f"its record was replaced ({e})"
        if other is not None and other.owner == self.owner and not other.released:
            return token
        now = self.clock()
        self.lost = (
            f"this job lost the writer lease of {self.storage.describe()}: "
            + (f"it is now held by {other.describe(now)}" if other is not None else gone)
            + "; it commits nothing more (two writers would mix one run's checkpoints)"
        )
        self._stop.set()
        logger.log(logging.ERROR if loud else logging.DEBUG, "%s", self.lost)  # at release: it is over anyway
        if self.on_lost is not None:
            self.on_lost(self.lost)
        raise LeaseLostError(self.lost, other)

    def fence(self) -> float:
        """Before a commit (step 3): still ours, and good for ``ttl_s`` more seconds; else ``LeaseLostError``.
        Returns the monotonic time the manifest must land by: ``fence_bound`` after the renewal was sent (it
        may land long before its reply), which a job that takes the lease over on purpose waits out."""
        sent = time.monotonic()
        self.renew()
        return sent + fence_bound(self.ttl_s)

    def release(self) -> None:
        """Mark the record released (step 4), so the next writer starts at once. Idempotent; never raises."""
        self._stop.set()
        with self._lock:
            if not self.held:
                return
            try:
                self.renew(released=True)
            except LeaseLostError:
                return
            except StorageError as e:
                logger.warning(
                    "cannot release the writer lease of %s (%s): the next job waits until it expires (%.0f s)",
                    self.storage.describe(),
                    e,
                    self.ttl_s,
                )
                return
            self.released = True
            logger.debug("released the writer lease of %s", self.storage.describe())


def _release_at_exit(ref: weakref.ref[Lease]) -> None:
    """At interpreter exit, release a lease the program left held (weakly: a forgotten lease goes)."""
    lease = ref()
    if lease is not None:
        lease.release()
