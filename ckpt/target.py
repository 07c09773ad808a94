"""Where a manager's checkpoints live: one root (`SingleRoot`) or a local tier beside it (`tiers.Tiers`).

Both answer the same questions, so the manager chooses once, in ``__init__``, and never asks which it has: where
a save commits, what happens after a commit, where a restore looks and in which order, which steps exist, how a
damaged step is set aside.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from . import catalog, layout
from . import lease as lease_mod
from .distributed import Ranks
from .errors import CorruptCheckpointError, LeaseHeldError, StorageError
from .save import WritePlan
from .storage import Storage

log = logging.getLogger("ckpt")

LOCAL, PEER, DURABLE = "local", "peer", "durable"


class Step(int):
    """A committed step (an int, compared and sorted as one) and the tiers holding it, e.g. ``("local", "durable")``."""

    tiers: tuple[str, ...]

    def __new__(cls, step: int, tiers: Iterable[str]) -> "Step":
        self = super().__new__(cls, step)
        self.tiers = tuple(tiers)
        return self


@dataclass(frozen=True)
class Source:
    """Where a restore reads a step: its tier and, for the local tier, the ranks that first get their lost copy
    back from the rank holding their replica (rank -> holder)."""

    step: int
    tier: str
    heal: dict[int, int] = field(default_factory=dict)


# persist ended: (step, error, seconds, bytes copied; None: the step was durable already)
Persisted = Callable[[int, BaseException | None, float, int | None], None]


class Target(Protocol):
    """What a manager saves to and restores from."""

    private: bool  # every rank commits its own copy (a local tier) rather than its share of one
    local_root: str | None  # this rank's local tier's directory (one root: None)
    commit_tier: str | None  # the tier a save commits to, as told to the tracker (one root: None)
    persist_every: int | None  # every how many saves one is persisted to the durable root (one root: None)

    def writable(self, durable_lease: lease_mod.Lease | None) -> tuple[Storage, lease_mod.Lease | None]:
        """Where the next save commits, and the lease that guards it."""

    def taken(self, step: int) -> Storage | None:
        """The root where `step` is committed already (a committed step is never saved again), else None."""

    def committed(
        self, plan: WritePlan, durable_lease: lease_mod.Lease | None, persisted: Persisted, persist: bool | None
    ) -> bool:
        """A save committed (writer thread); returns whether the durable root's retention runs now (else after
        its persist, which calls `persisted`)."""

    def persist(self, step: int, durable_lease: lease_mod.Lease | None, persisted: Persisted) -> bool:
        """Persist `step`, the newest save, to the durable root if it was not; True if a persist was queued."""

    def sources(self, durable: list[int]) -> list[Source]:
        """Every source a restore may try, newest first (one list for every rank)."""

    def storage_of(self, source: Source) -> Storage:
        """The root this rank reads `source` from."""

    def heal(self, source: Source) -> CorruptCheckpointError | None:
        """Bring back lost copies `source` needs before it is read; this rank's failure, if any."""

    def resumed(self, source: Source, remaining: list[Source]) -> None:
        """The job resumed from `source` (`remaining`: the sources not tried)."""

    def left_behind(self, step: int | None) -> None:
        """The job resumed from the newest step any restore could take (None: none): what is newer beside the
        durable root was left behind by an earlier attempt and would keep the job from saving those steps again."""

    def steps(self, durable: Iterable[int]) -> list[Step]:
        """Committed steps, ascending, each with its tiers."""

    def delete_local(self, step: int) -> None:
        """Delete `step` from the tiers beside the durable root (now: a local delete is a file removal)."""

    def persisting(self) -> set[int]:
        """The step being copied to the durable root in the background, if any."""

    def where(self, source: Source) -> str:
        """Words naming the tier of `source` in a message ("" with one tier)."""

    def set_aside(
        self, source: Source, error: CorruptCheckpointError, own: BaseException | None, lease: lease_mod.Lease | None
    ) -> str:
        """Quarantine a damaged step; say where it went or why it stayed."""

    def metadata_roots(self, step: int) -> list[Storage]:
        """The roots whose manifest of `step` a metadata read tries, in order (the next when one is damaged)."""

    def replicas(self) -> list[Storage]:
        """The roots kept inside the root a save commits to, under its lease: a local tier's peer replicas."""

    def wait(self) -> None:
        """Until the work a commit started in the background (a persist) has ended."""

    def close(self) -> None: ...


def set_aside_durable(
    storage: Storage, ranks: Ranks, step: int, error: CorruptCheckpointError, lease: lease_mod.Lease | None
) -> str:
    """Quarantine a damaged step of the durable root: rank 0 does it for all, under the root's lease (borrowed for
    the move when this manager holds none: moving a step is a write, never beside another live writer).

    A quarantine that fails (a file system's OSError, an object store's `StorageError`: read-only credentials, a
    store gone away) leaves the step in place and says why: the restore still falls back to the previous step."""
    if not ranks.leader:
        return "quarantined by rank 0"
    borrowed = None
    try:
        if lease is None:
            borrowed = lease_mod.acquire(storage, role="quarantine", wait_for_gc=0)
        return f"quarantined to {catalog.quarantine(storage, step, str(error))}"
    except LeaseHeldError as e:
        return f"left in place ({e})"
    except (OSError, StorageError) as e:
        log.warning("could not quarantine damaged step %d of %s: %s", step, storage.url, e)
        return f"could not be quarantined ({e})"
    finally:
        if borrowed is not None:
            borrowed.release()


class SingleRoot:
    """One durable root: a save commits there, retention follows each commit, a restore reads it newest first."""

    private = False
    commit_tier = None
    local_root = None

    @property
    def persist_every(self) -> None:
        """No persists: one root."""
        return None

    @persist_every.setter
    def persist_every(self, k: int) -> None:
        raise ValueError(f"persist_every={k!r} needs a local tier (local=): with one root every save is durable")

    def __init__(self, storage: Storage, ranks: Ranks):
        self.storage, self.ranks = storage, ranks

    def writable(self, durable_lease: lease_mod.Lease | None) -> tuple[Storage, lease_mod.Lease | None]:
        return self.storage, durable_lease

    def taken(self, step: int) -> Storage | None:
        return self.storage if layout.is_committed(self.storage, step) else None

    def committed(
        self, plan: WritePlan, durable_lease: lease_mod.Lease | None, persisted: Persisted, persist: bool | None
    ) -> bool:
        return True

    def persist(self, step: int, durable_lease: lease_mod.Lease | None, persisted: Persisted) -> bool:
        return False  # committed to the one root: durable already

    def sources(self, durable: list[int]) -> list[Source]:
        return [Source(s, DURABLE) for s in sorted(durable, reverse=True)]

    def storage_of(self, source: Source) -> Storage:
        return self.storage

    def heal(self, source: Source) -> CorruptCheckpointError | None:
        return None

    def resumed(self, source: Source, remaining: list[Source]) -> None:
        pass

    def left_behind(self, step: int | None) -> None:
        pass

    def steps(self, durable: Iterable[int]) -> list[Step]:
        return [Step(s, (DURABLE,)) for s in durable]

    def delete_local(self, step: int) -> None:
        raise AssertionError(f"step {step}: a single root has no local tier")

    def persisting(self) -> set[int]:
        return set()

    def replicas(self) -> list[Storage]:
        return []

    def where(self, source: Source) -> str:
        return ""

    def set_aside(
        self, source: Source, error: CorruptCheckpointError, own: BaseException | None, lease: lease_mod.Lease | None
    ) -> str:
        return set_aside_durable(self.storage, self.ranks, source.step, error, lease)

    def metadata_roots(self, step: int) -> list[Storage]:
        return [self.storage]

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass
