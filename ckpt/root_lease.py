"""The durable root's writer lease as the ranks share it: rank 0 holds it for all, from the first write until
close, and every rank learns at once when it is refused (one writer per root)."""

from __future__ import annotations

from . import lease as lease_mod
from .distributed import Ranks
from .errors import LeaseHeldError, StorageError
from .storage import Storage


class RootLease:
    """Rank 0's lease of `storage`, taken by the first `take`, checked by every later one."""

    def __init__(self, storage: Storage, ranks: Ranks, ttl: float):
        self.storage, self.ranks, self.ttl = storage, ranks, ttl
        self.lease: lease_mod.Lease | None = None  # rank 0's, once taken
        self._agreed = False  # every rank knows the lease is held

    @property
    def agreed(self) -> bool:
        """Whether every rank knows the lease is held (a collective `take` succeeded): later takes are rank 0's."""
        return self._agreed

    def take(self, collective: bool) -> None:
        """Hold the lease (rank 0) or check it is still held; `collective`: every rank takes part (a save), so a
        refusal reaches every rank at once, none waiting in a collective for a rank that gave up."""
        error: LeaseHeldError | StorageError | OSError | None = None
        if self.ranks.leader:
            try:
                if self.lease is None:
                    self.lease = lease_mod.acquire(self.storage, ttl=self.ttl)
                else:
                    self.lease.check()
            except (LeaseHeldError, StorageError, OSError) as e:  # a root that cannot be created too: every
                error = e  # rank learns it, none waits for rank 0 in the broadcast below until the collective timeout
        if collective and not self._agreed:
            verdict = self.ranks.broadcast_json(None if error is None else str(error))
            if verdict and error is None:
                error = LeaseHeldError(verdict)
            self._agreed = verdict is None
        if error is not None:
            raise error

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
