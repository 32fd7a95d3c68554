"""The run's writer lease for a Guard or a trainer integration: global rank 0 holds it, every rank
hears whether it got it.

One writer per run (``spotguard.checkpoint.leaseholder``): in a process group rank 0 writes every
manifest anyway, so it alone takes the lease and its commits are the fenced ones (its owner hands
``fence`` to the checkpoint writers, which call it before each manifest); the other ranks
learn the outcome through one broadcast, so that every rank raises alike instead of waiting in a
collective for a rank 0 that stopped. The owner (a ``Guard``, ``FolderCheckpoints``) is held weakly:
the heartbeat thread never keeps it alive, and releases the lease once it is gone unclosed.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from spotguard.checkpoint.collective import broadcast
from spotguard.checkpoint.leaseholder import Lease
from spotguard.coordination import ranks
from spotguard.errors import LeaseHeldError, StorageError
from spotguard.storage.base import Storage

if TYPE_CHECKING:
    from spotguard.coordination.agreement import Agreement

logger = logging.getLogger(__name__)


class Owner(Protocol):
    def _lease_lost(self, why: str) -> None:
        """From the heartbeat thread: another job took the lease over (mark the heartbeat, stop soon)."""


class WriterLease:
    """``hold()`` before the first load or write (collective in a process group), ``release()`` when done.

    ``agreement`` may be set later (an integration's group is made on first use), before ``hold()``.
    """

    def __init__(
        self, storage: Storage, ttl_s: float | None, takeover: bool, agreement: Agreement | None, owner: Owner
    ) -> None:
        self.storage, self.ttl_s, self.takeover, self.agreement = storage, ttl_s, takeover, agreement
        self.enabled = ttl_s is not None
        self.holder: Lease | None = None
        self._owner = weakref.ref(owner)
        self._unsupported = False  # rank 0: the storage has no conditional writes
        #: Whether ``hold()`` succeeded and nothing released it since: the same on every rank.
        self.held = False

    @property
    def lost(self) -> str | None:
        """Why this job lost the lease to another (on the rank that held it), else None."""
        return None if self.holder is None else self.holder.lost

    def _make_holder(self) -> Lease | None:
        if self.holder is None and self.ttl_s is not None and not self._unsupported:
            # Global rank 0 only, also before the process group exists (Lightning resumes before it makes
            # one): every rank of a launcher then runs the single-process path, rank 0 alone holding the lease.
            if (self.agreement.rank if self.agreement is not None else ranks.rank()) == 0:
                ref = self._owner

                def on_lost(why: str) -> None:
                    owner = ref()
                    if owner is not None:
                        owner._lease_lost(why)

                self.holder = Lease(
                    self.storage, self.ttl_s, takeover=self.takeover, on_lost=on_lost, alive=lambda: ref() is not None
                )
        return self.holder

    def hold(self) -> None:
        """Take the lease (idempotent); ``LeaseHeldError`` on every rank while another job holds it."""
        if self.held or not self.enabled:
            return
        failure: tuple[str, str] | None = None
        other = None
        holder = self._make_holder()
        if holder is not None:
            try:
                holder.acquire()
            except NotImplementedError:
                logger.warning(
                    "%s has no conditional writes: no writer lease, so a second job on it would mix one run",
                    self.storage.describe(),
                )
                self.holder, self._unsupported = None, True
            except LeaseHeldError as e:
                failure, other = ("held", str(e)), e.holder
            except Exception as e:
                if self.agreement is None:
                    raise
                failure = ("error", f"rank 0 cannot take the writer lease: {type(e).__name__}: {e}")
        if self.agreement is not None:
            failure = broadcast(failure, self.agreement.save_group)
        if failure is not None:
            kind, message = failure
            if kind == "held":
                raise LeaseHeldError(message, other)
            raise StorageError(message)
        self.held = True

    def fence(self) -> float | None:
        """The writers call it before each manifest: ``LeaseLostError`` once this job lost the lease (or
        released it), else the lease is extended and the manifest's deadline returned (``Lease.fence``).
        Nothing to check on a rank that took none."""
        if self.holder is not None and self.holder.record is not None:
            return self.holder.fence()
        return None

    def release(self) -> None:
        """Nothing more is written: mark the lease released so that the next job starts at once."""
        self.held = False
        if self.holder is not None:
            self.holder.release()
