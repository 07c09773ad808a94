"""The durable root's writer lease as the ranks share it: rank 0 holds it for all, from the first write until
close, and every rank learns at once when it is refused (one writer per root)."""

from __future__ import annotations

from . import lease as lease_mod
from .distributed import Ranks
from .errors import CheckpointError, LeaseHeldError, StorageError
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
            told = self.ranks.broadcast_json({"error": None if error is None else str(error), "id": self._id()})
            if told["error"] and error is None:
                error = LeaseHeldError(told["error"])
            if error is None and self.ranks.world_size > 1:
                error = self._same_root(told["id"])
            self._agreed = error is None
        if error is not None:
            raise error

    def _id(self) -> str | None:
        return None if self.lease is None else self.lease.id

    def _same_root(self, leader_id: str) -> CheckpointError | None:
        """Every rank reads the lease rank 0 just took from its own root, once (a collective): a rank that cannot see
        it writes somewhere else (a node-local path given on several nodes, or another path per rank), and rank 0
        would commit steps naming files that are not there. The error names those ranks, on every rank."""
        if self.ranks.leader:
            mine = None
        else:
            try:
                seen = (lease_mod.recorded_holder(self.storage) or {}).get("id")  # rank 0's pid: maybe not seen here
            except Exception as e:  # an unreadable lease is no proof of the same root either
                seen = f"unreadable ({e})"
            mine = None if seen == leader_id else f"rank {self.ranks.rank} sees {seen or 'none'}"
        blind = [m for m in self.ranks.all_gather_json(mine) if m]
        if not blind:
            return None
        return CheckpointError(
            f"the ranks do not share the root {self.storage.url}: rank 0 holds its lease {leader_id}, "
            f"{'; '.join(blind[:5])}{' ...' if len(blind) > 5 else ''}. Every rank must reach the same root (a shared "
            "file system or an object store, not a path on each node's own disk)"
        )

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
