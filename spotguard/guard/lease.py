"""The Guard's share of the run's writer lease: global rank 0 holds it, every rank hears whether it got it.

One writer per run (``spotguard.checkpoint.leaseholder``): in a process group rank 0 writes every
manifest anyway, so it alone takes the lease and its commits are the fenced ones; the other ranks
learn the outcome through one broadcast, so that every rank raises alike instead of waiting in a
collective for a rank 0 that stopped.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from spotguard.checkpoint.collective import broadcast
from spotguard.checkpoint.leaseholder import Lease
from spotguard.errors import LeaseHeldError, StorageError
from spotguard.storage.base import Storage

if TYPE_CHECKING:
    from spotguard.guard.agreement import Agreement
    from spotguard.guard.guard import Guard
    from spotguard.guard.options import GuardOptions

logger = logging.getLogger(__name__)


class WriterLease:
    """``hold()`` before the first load or write (collective in a process group), ``release()`` when done."""

    def __init__(self, storage: Storage, options: GuardOptions, agreement: Agreement | None, guard: Guard) -> None:
        self.storage, self.agreement = storage, agreement
        self.enabled = options.lease_ttl is not None
        self.holder: Lease | None = None
        if options.lease_ttl is not None and (agreement is None or agreement.rank == 0):
            # Weakly: the heartbeat thread must not keep an unclosed guard (its model, its groups) alive.
            ref = weakref.ref(guard)

            def on_lost(why: str) -> None:
                owner = ref()
                if owner is not None:
                    owner._lease_lost(why)

            self.holder = Lease(
                storage,
                options.lease_ttl,
                takeover=bool(options.takeover),
                on_lost=on_lost,
                alive=lambda: ref() is not None,
            )
        #: Whether ``hold()`` succeeded and nothing released it since: the same on every rank.
        self.held = False

    @property
    def lost(self) -> str | None:
        """Why this job lost the lease to another (on the rank that held it), else None."""
        return None if self.holder is None else self.holder.lost

    def hold(self) -> None:
        """Take the lease (idempotent); ``LeaseHeldError`` on every rank while another job holds it."""
        if self.held or not self.enabled:
            return
        failure: tuple[str, str] | None = None
        other = None
        if self.holder is not None:
            try:
                self.holder.acquire()
            except NotImplementedError:
                logger.warning(
                    "%s has no conditional writes: no writer lease, so a second job on it would mix one run",
                    self.storage.describe(),
                )
                self.holder = None
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

    def release(self) -> None:
        """This guard writes nothing more: mark the lease released so that the next job starts at once."""
        self.held = False
        if self.holder is not None:
            self.holder.release()
