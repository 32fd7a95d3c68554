"""An integration's share of the process group: the ``Guard``'s rank agreement, made on first use."""

from __future__ import annotations

from spotguard.coordination import agreement, ranks
from spotguard.coordination.agreement import Agreement
from spotguard.coordination.window import WindowPolicy


class RankGroup:
    """An integration's share of the process group: the ``Guard``'s agreement (two small gloo
    groups), made on first use, on every rank at the same point (making it is collective).
    ``get()`` is None in a single process, or before ``torch.distributed`` is initialised. Making it checks
    that every rank uses the same deadline policy (``ConfigError`` on every rank otherwise)."""

    def __init__(self, windowing: WindowPolicy | None = None) -> None:
        self._agreement: Agreement | None = None
        self._settled = False
        self._same = (windowing or WindowPolicy()).settings()

    def get(self) -> Agreement | None:
        if self._settled:
            return self._agreement  # the per-step path: no look at torch.distributed
        if self._agreement is None and ranks.is_distributed() and ranks.world_size() > 1:
            self._agreement = agreement.setup(sync_every=1, same=self._same)
        return self._agreement

    def settle(self) -> None:
        """From now on (training runs: the process group, if any, is up) ``get()`` is one attribute read."""
        self.get()
        self._settled = True

    @property
    def rank(self) -> int:
        """The agreement's rank, else the launcher's (``ranks.rank``): 0 in a single process."""
        return self._agreement.rank if self._agreement is not None else ranks.rank()

    def close(self) -> None:
        """Destroy spotguard's groups (idempotent); a later ``get()`` makes new ones."""
        self._settled = False
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
