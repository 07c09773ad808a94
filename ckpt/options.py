"""A manager's settings as types: how a save writes (`WriteOptions`), the local tier beside the root
(`TierOptions`) and how this process reaches and shares the root (`RootOptions`).

Each is checked when it is made, so a bad value fails where it is written, naming the field. The manager's
keywords of the same names are shorthands for them (`merge`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from .budget import WriteBudget
from .format import MAX_CHUNK_BYTES, PACK_BYTES
from .lease import TTL_S
from .observer import check_observer
from .retention import KeepLast, RetentionPolicy, policy_of
from .snapshot import MODES
from .staging import check_max_bytes


@dataclass(frozen=True)
class WriteOptions:
    """How a save writes.

    Args:
        snapshot: ``"sync"`` (default): every tensor is copied to host memory inside `save`, so a checkpoint holds
            exactly the state at `save` whatever the code does next. ``"overlap"`` (opt-in: a shorter stall): the
            parameters and state tensors of the torch optimizers in a saved state are copied after `save`
            returns, beside the next forward and backward, and the next ``optimizer.step()`` waits for that copy
            (`ckpt.snapshot`). Its contract: between `save` and the next ``optimizer.step()`` nothing but that
            step writes those tensors, or `SaveHandle.wait_snapshot()` is called first. A write that bumps a
            version counter (``p.mul_()`` under ``no_grad``, ``load_state_dict``, the in-place renorm of
            ``nn.Embedding(max_norm=...)`` in forward) fails the save (`StateChangedError`) when it comes before
            the copy: a race. One that bumps none (through ``p.data``, a numpy view, an EMA swap through
            ``.data``, ``opt.state[p]["exp_avg"].data.zero_()``) is committed silently.
        chunk_bytes: the smallest data file (a rank's pack is cut into at most 4 files of at least this size) and
            the target size of one chunk file of an array of its own (at most 4 GiB).
        pack_bytes: the boxes (a rank's slice of a tensor) of the tensors whose every box is at most this size are
            placed in their writer's pack, at most 4 files per rank and step whatever the number of tensors
            (docs/checkpointing.md, "On disk"), in the durable root and the local tier alike. Default: every tensor.
            0: every tensor an array of its own, chunked by `chunk_bytes`, files growing as tensors times ranks.
        max_staging_bytes: cap on the host snapshot buffer; larger states are snapshotted in waves.
        write_budget: what a background write may use of the machine: a `WriteBudget` (share of the CPUs,
            file operations per core, niceness of the write's threads) or a number, the share of the CPUs.
            Default `WriteBudget()`: half the cores, 2 file operations per core, threads at nice 10, so that
            training comes first when both want the CPU (docs/checkpointing.md, "Background writes and training").
        io_threads: concurrent chunk reads on restore.
    """

    snapshot: str = "sync"
    chunk_bytes: int = 64 << 20
    pack_bytes: int = PACK_BYTES
    max_staging_bytes: int | None = None
    write_budget: WriteBudget | float | None = None
    io_threads: int = 8

    def __post_init__(self) -> None:
        _ints(self, "chunk_bytes", "pack_bytes", "io_threads")
        if self.max_staging_bytes is not None:
            _ints(self, "max_staging_bytes")
        check_max_bytes(self.max_staging_bytes)
        if self.snapshot not in MODES:
            raise ValueError(f"snapshot must be one of {MODES}, got {self.snapshot!r}")
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be >= 0, got {self.pack_bytes}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        WriteBudget.of(self.write_budget)  # a bad one fails here

    @property
    def budget(self) -> WriteBudget:
        """`write_budget` as a `WriteBudget`."""
        return WriteBudget.of(self.write_budget)


@dataclass(frozen=True)
class TierOptions:
    """A fast local tier beside the durable root: every save commits there, every K-th is also persisted.

    Args:
        local: a directory on this machine (NVMe, ``/dev/shm``): every save commits there, and the manager's root
            becomes the durable tier. ``{rank}`` in it is replaced by the rank (each rank needs its own).
        persist_every: every K-th committed save since the last persist (counted from the manager's start, or
            from its first save when `restore` took a local step the durable tier lacks: that save is persisted; a
            retuned K takes `CheckpointManager.persist_every`) is also persisted to the root in the background, copied from the local tier's committed files (verified); the manager's
            retention applies to the root.
        keep_local: how many committed steps the local tier keeps (`KeepLast`), unless `local_retention` is given.
        local_retention: the local tier's `RetentionPolicy`; its newest step and a step being persisted are kept.
        replica_offset: with torch.distributed, each rank's local step is also sent to the local tier of rank
            ``(rank + replica_offset) % world`` (default: the ranks per node, from LOCAL_WORLD_SIZE, else 1), so
            that a lost node's steps come back from its peer; 0: no replica.
    """

    local: str | os.PathLike
    persist_every: int = 1
    keep_local: int = 2
    local_retention: RetentionPolicy | None = None
    replica_offset: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.local, (str, os.PathLike)) or not os.fspath(self.local):
            raise TypeError(f"local must be a directory (a str or path), got {self.local!r}")
        _ints(self, "persist_every", "keep_local")
        if self.replica_offset is not None:
            _ints(self, "replica_offset")
        if self.persist_every < 1 or self.keep_local < 1:
            raise ValueError(
                f"persist_every and keep_local must be >= 1, got {self.persist_every} and {self.keep_local}"
            )
        if self.local_retention is not None and not isinstance(self.local_retention, RetentionPolicy):
            raise TypeError(f"local_retention must be a RetentionPolicy, got {self.local_retention!r}")

    @property
    def retention(self) -> RetentionPolicy:
        """The local tier's policy: `local_retention`, else the newest `keep_local` steps."""
        return self.local_retention if self.local_retention is not None else KeepLast(self.keep_local)


@dataclass(frozen=True)
class RootOptions:
    """How this process reaches the root and shares it with other writers and ranks.

    Args:
        storage_options: object-store settings (endpoint, region, credentials, timeout...; see
            docs/object_stores.md); the standard AWS variables apply without them.
        lease_ttl: object stores: seconds after which a writer that stopped renewing its lease (a crash) loses
            it, so gc may clean its leftovers and another writer take the root; renewed every ttl/4.
        run_id: this run's id, recorded in ROOT/run.json by the first save (default: from the launcher's
            environment, else a new random id); see `ckpt.run`. Integrations compare it at a fresh start.
        collective_timeout: seconds a rank waits for the others during a save or restore before failing.
    """

    storage_options: Mapping[str, Any] | None = None
    lease_ttl: float = TTL_S
    run_id: str | None = None
    collective_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict, got {self.storage_options!r}")
        if self.run_id is not None and not (isinstance(self.run_id, str) and self.run_id):
            raise TypeError(f"run_id must be a non-empty str, got {self.run_id!r}")
        _numbers(self, "lease_ttl", "collective_timeout")
        if not self.lease_ttl > 0:
            raise ValueError(f"lease_ttl must be positive seconds, got {self.lease_ttl!r}")
        if not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout must be positive seconds, got {self.collective_timeout!r}")


Options = TypeVar("Options", WriteOptions, TierOptions, RootOptions)


def _ints(options: Any, *names: str) -> None:
    """Each named field is an int (not a bool), else a TypeError naming it."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")


def _numbers(options: Any, *names: str) -> None:
    """Each named field is a real number (not a bool), else a TypeError naming it."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of seconds, got {value!r}")


def resolve(
    write: WriteOptions | None, tiers: TierOptions | None, root_options: RootOptions | None, **keywords: Any
) -> tuple[WriteOptions, TierOptions | None, RootOptions]:
    """The options a manager runs with: each group from its object or from the keywords naming its fields."""
    groups = (
        (WriteOptions, write, "write"),
        (TierOptions, tiers, "tiers"),
        (RootOptions, root_options, "root_options"),
    )
    write_, tiers_, root_ = (
        _merge(kind, given, name, **{k: v for k, v in keywords.items() if k in _fields(kind)})
        for kind, given, name in groups
    )
    return write_, tiers_, root_  # type: ignore[return-value]  (only TierOptions has a required field)


def _fields(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def _merge(kind: type[Options], given: Options | None, name: str, **shorthands: Any) -> Options | None:
    """The options a manager runs with: `given` (the ``name=`` keyword), or one made of the shorthand keywords that
    are set (not None); both at once is an error naming them. None when neither is given and `kind` has a
    required field (no tier unless ``local=`` is given)."""
    set_ = {k: v for k, v in shorthands.items() if v is not None}
    if given is not None:
        if not isinstance(given, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {given!r}")
        if set_:
            raise ValueError(f"give {name}= or the keywords {sorted(set_)}, not both")
        return given
    required = [f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING]
    if any(r not in set_ for r in required):
        if set_:
            raise ValueError(f"{sorted(set_)} need {' and '.join(f'{r}=' for r in required)}")
        return None
    return kind(**set_)


# retention=, keep_last=... as CheckpointManager has them
RETENTION_KEYWORDS = frozenset(inspect.signature(policy_of).parameters)


def typed(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """A manager's keywords with every shorthand folded into its option object (``write=``, ``tiers=``,
    ``root_options=``) and checked now; the others (retention, tracker) as they are. What an integration hands
    the manager, so that a bad value fails where the integration was configured."""
    groups = {"write", "tiers", "root_options"}
    fields = _fields(WriteOptions) | _fields(TierOptions) | _fields(RootOptions)
    rest = {k: v for k, v in keywords.items() if k not in fields and k not in groups}
    unknown = sorted(set(rest) - RETENTION_KEYWORDS - {"tracker"})
    if unknown:
        raise TypeError(
            f"unknown CheckpointManager option(s) {unknown}; known: {sorted(fields | groups | RETENTION_KEYWORDS | {'tracker'})}"
        )
    policy_of(**{k: v for k, v in rest.items() if k in RETENTION_KEYWORDS})
    check_observer(rest.get("tracker"))
    write, tiers, root = resolve(
        keywords.get("write"),
        keywords.get("tiers"),
        keywords.get("root_options"),
        **{k: v for k, v in keywords.items() if k in fields},
    )
    return {**rest, "write": write, "tiers": tiers, "root_options": root}
