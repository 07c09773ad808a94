"""Two tiers: every save commits to this rank's local tier, every K-th one is also persisted to the durable root.

The policy of the tiers: what each tier keeps, which step a persist copies and when, where a restore reads
first (the newest intact step, the local tier before the durable one for the same step) and which peer sends a
lost local copy back. The bytes move in `persist.py` (local tier -> durable root, verified, manifest last) and
`replica.py` (a rank's local step -> its peer's local tier, over gloo).

Who holds which lease: each rank holds its own local tier's (a directory of its own: ``{rank}`` in the path
is replaced by the rank), rank 0 holds the durable root's for all, as in a single-tier save. A peer's replica
lives inside the holder's local tier, under its lease.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from typing import Callable, Iterable

from . import catalog, layout
from . import lease as lease_mod
from . import run as run_mod
from .distributed import Box, Ranks, ranks_per_node
from .errors import CorruptCheckpointError, LeaseHeldError, RunMismatchError, StepNotFoundError, described
from .options import TierOptions
from .persist import PersistJob
from .planner import ArrayPlan
from .pools import submit_or_run
from .replica import transfer
from .retention import StepMetadata, doomed
from .save import WritePlan
from .storage import LocalStorage, Storage, check_writable, local_dir
from .target import DURABLE, LOCAL, Persisted, Source, Step, set_aside_durable

log = logging.getLogger("ckpt")


def restore_order(durable: Iterable[int], inventories: list[dict]) -> list[Source]:
    """Every source a restore may try, newest step first; for a step in both tiers, the local tier first.

    A step is in the local tier when every rank holds it in its own local tier or a peer holds a replica of it;
    `inventories` are the ranks' `Tiers.inventory()`, in rank order. A rank whose local tier is another run's
    (`"other_run"`) has no local copy and none is brought back into it: only the durable tier is read. A step some
    ranks hold locally that cannot be read there is logged with the rank that lacks it: the restore takes an older
    step or the durable copy, and says why.
    """
    own = [set(inv["local"]) for inv in inventories]
    other = [bool(inv.get("other_run")) for inv in inventories]
    held = [{int(r): set(steps) for r, steps in inv["replica"].items()} for inv in inventories]
    durable = set(durable)
    out = []
    for s in sorted(durable.union(*own), reverse=True):
        heal: dict[int, int] | None = {}
        for r in range(len(inventories)):
            if s in own[r]:
                continue
            if other[r]:
                heal = None
                break
            holder = next((h for h in range(len(inventories)) if h != r and s in held[h].get(r, ())), None)
            if holder is None:
                heal = None
                if any(s in mine for mine in own):
                    log.warning(
                        "step %d is not restored from the local tiers: rank %d holds no copy of it and no peer keeps "
                        "a replica of it (a lost local tier, or an attempt killed before every rank committed it); "
                        "trying %s",
                        s,
                        r,
                        "its durable copy" if s in durable else "an older step",
                    )
                break
            heal[r] = holder
        if heal is not None:
            out.append(Source(s, LOCAL, heal))
        if s in durable:
            out.append(Source(s, DURABLE))
    return out


def default_offset(world_size: int) -> int:
    """Replicate to the same local rank of the next node (torchrun's LOCAL_WORLD_SIZE), else to the next rank."""
    per_node = ranks_per_node()
    return per_node if per_node < world_size else 1


def _resolved(url: str) -> str:
    """A root's URL with a local path's links resolved (one directory under two names is one root)."""
    return url if "://" in url else os.path.realpath(url)


def _recorded(storage: Storage) -> run_mod.Run | None:
    """The run a root records, if it records a readable one."""
    try:
        return run_mod.recorded_run(storage)
    except CorruptCheckpointError:
        return None


class Tiers:
    """This rank's local tier beside the durable root (a `target.Target`): local commits, background persists,
    replicas, the local tier's retention (`retention`, of which the newest step is always kept)."""

    private = True
    commit_tier = LOCAL

    def __init__(self, durable: Storage, options: TierOptions, ranks: Ranks, timeout: timedelta):
        local, replica_offset = options.local, options.replica_offset
        path = local_dir(os.fspath(local).replace("{rank}", str(ranks.rank)))
        if path is None:
            raise ValueError(f"local= must be a directory on this machine (NVMe, /dev/shm), got {local!r}")
        self.local = LocalStorage(path)
        self.local.check_creatable()
        if os.path.isdir(self.local.root):  # every save commits here: an existing read-only one would fail each
            check_writable(self.local.root, f"the local tier {self.local.root} cannot be written")
        if _resolved(durable.url) == _resolved(self.local.root):  # under another name (a link) too
            raise ValueError(f"the local tier {self.local.root} must not be the durable root {durable.url}")
        self.durable, self.ranks = durable, ranks
        self._persist_every, self.retention = options.persist_every, options.retention
        self.on_local_delete: Callable[[int], None] | None = None  # told each step deleted from the local tier
        offset = default_offset(ranks.world_size) if replica_offset is None else replica_offset
        self.offset = offset % ranks.world_size if ranks.world_size > 1 else 0
        # persists run beside the next save: collectives of their own, on a group of their own
        self._persist_ranks = Ranks.current(timeout) if ranks.world_size > 1 else ranks
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._persisting: tuple[int, Future] | None = None
        self._unpersisted = 0  # committed saves since the last persist (counted alike on every rank)
        # the newest local commit: its step, this rank's designated boxes and its part of the shared root's plan
        self._newest: tuple[int, dict[str, Box], ArrayPlan] | None = None
        self.lease: lease_mod.Lease | None = None
        self._durable_above: int | None = None  # rank 0: steps above it are in no durable root (`taken`)
        self._own = False  # the local tier was found to be this run's: this manager records its run there
        self._superseded: list[tuple[LocalStorage, int]] = []  # newer steps of another world size: the next save's

    @property
    def local_root(self) -> str:
        """This rank's local tier's directory."""
        return self.local.root

    def other_run(self) -> tuple[str, run_mod.Run | None] | None:
        """(the local tier's run, described; the durable root's) when the local tier is another run's, or may be;
        None when it is this one's.

        A run's first save records it in every rank's local tier, with the durable root's URL, and only then in the
        durable root, each keeping the ids it recorded before (`run.lineage`). So the local tier of this job holds
        the run its durable root records in its lineage, whatever instant an attempt died at. Another run's local
        tier names another durable root, or (a durable root taken over by another run) lacks the run the durable
        root records: its steps are never restored, listed, counted or deleted, and a save into it is refused. So
        is a local tier whose record is damaged: whose steps it holds cannot be told. A local tier without a record
        (new, or older than run records), or whose durable root records no run yet, is this run's. Not the
        manager's own id: without a launcher's id each process draws a new one, and a restart must still resume its
        local steps."""
        if self._own:
            return None
        try:
            local = run_mod.recorded_run(self.local)
            url, lineage = run_mod.durable_root(self.local), run_mod.lineage(self.local)
        except CorruptCheckpointError as e:
            return f"a run its damaged record does not name ({e})", _recorded(self.durable)
        if local is None:
            return None
        durable = _recorded(self.durable)
        if url is not None and _resolved(url) != _resolved(self.durable.url):
            return local.describe(), durable
        return None if durable is None or durable.id in lineage else (local.describe(), durable)

    def _held_steps(self) -> list[int]:
        """The committed steps of this rank's local tier and of the replicas it keeps."""
        return sorted({s for storage in [self.local, *self.replicas()] for s in layout.committed_steps(storage)})

    def take_lease(self) -> lease_mod.Lease:
        """This rank's local tier's lease (held until `close`): one writer per local tier."""
        if self.lease is None:
            try:
                self.lease = lease_mod.acquire(self.local)
            except LeaseHeldError as e:
                hint = (
                    "; each rank needs a local tier of its own: put {rank} in local="
                    if self.ranks.world_size > 1
                    else ""
                )
                raise LeaseHeldError(f"local tier: {e}{hint}", holder=e.holder) from None
        else:
            self.lease.check()
        return self.lease

    def replica(self, rank: int) -> LocalStorage:
        """The replica of rank `rank`'s local tier kept in this one."""
        return LocalStorage(os.path.join(self.local.root, layout.replica_root(rank)))

    def replicas(self) -> list[LocalStorage]:
        """Every peer replica kept in this rank's local tier, written under its lease."""
        return [self.replica(r) for r in layout.replica_ranks(self.local)]

    def writable(self, durable_lease: lease_mod.Lease | None) -> tuple[Storage, lease_mod.Lease | None]:
        """A save commits to this rank's local tier, under its own lease; never into a local tier holding another
        run's steps (`RunMismatchError`, nothing written or deleted)."""
        lease = self.take_lease()  # first: a live writer of this tier is named as such
        other = self.other_run()
        steps = self._held_steps() if other is not None else []
        if other is not None and steps:
            local, durable = other
            lease.release()  # held only to look: another run's tier stays free for it
            self.lease = None
            try:
                written_for = run_mod.durable_root(self.local)
            except CorruptCheckpointError:
                written_for = None
            raise RunMismatchError(
                f"the local tier {self.local.url} holds committed steps {steps} of {local}"
                f"{f' for the durable root {written_for}' if written_for else ''}, and the durable "
                f"root {self.durable.url} records "
                f"{durable.describe() if durable is not None else 'no run (a new root)'}: a run never writes into, "
                f"restores or deletes another run's local tier. No step was written or deleted. Give this run a local "
                f"tier of its own (put the run id in local=, e.g. local='/local_nvme/ckpt/RUN_ID/{{rank}}'), or remove "
                f"{self.local.root} once that run needs it no more."
            )
        self._own = True  # this save records this run in the local tier (an empty one of another run's included)
        self._drop(self._superseded, "the step resumed from, saved at another world size")
        self._superseded = []
        return self.local, lease

    def storage_of(self, source: Source) -> Storage:
        return self.local if source.tier == LOCAL else self.durable

    def where(self, source: Source) -> str:
        return f" in the {source.tier} tier"

    def metadata_roots(self, step: int) -> list[Storage]:
        """The local tier first when it holds `step` (and is this run's), then the durable root: a damaged local
        manifest does not hide an intact durable copy."""
        mine = layout.is_committed(self.local, step) and self.other_run() is None
        return [self.local, self.durable] if mine else [self.durable]

    @property
    def persist_every(self) -> int:
        """Every how many committed saves one is persisted (`TierOptions.persist_every`; settable: a retuned K)."""
        return self._persist_every

    @persist_every.setter
    def persist_every(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"persist_every must be a positive int, got {k!r}")
        self._persist_every = k

    def resumed(self, source: Source, remaining: list[Source]) -> None:
        """A job resumed here: when it restored a local step the durable tier lacks, its first save is persisted,
        else the K-th; so a job whose attempts die before their K-th save still reaches the durable tier."""
        lagging = source.tier == LOCAL and Source(source.step, DURABLE) not in remaining
        self._unpersisted = self.persist_every - 1 if lagging else 0

    def left_behind(self, step: int | None) -> None:
        """Delete this rank's local steps newer than `step` (the one the job resumed from; None: none), and the
        replicas of such steps it keeps: an attempt killed between its local commits and their replicas leaves steps
        that some ranks hold and others lost, which no restore can take and the job's next saves of those steps
        would collide with (`StepExistsError`). Newer steps saved at another world size are deleted by the next save
        (`writable`): a restore alone keeps them for a restart at their world size. A local tier of another run is
        left alone; so is a local tier a live writer holds (a restore beside a training job): its newer steps are
        that writer's, not left behind, and the restore, already applied, stands."""
        if self.other_run() is not None:
            return
        self._superseded = self._newer(step, this_world=False)
        if self._newer(step, this_world=True):
            try:
                self.take_lease()
            except LeaseHeldError as e:
                log.info("local steps newer than step %s are left to the live writer of the local tier: %s", step, e)
                return
            self._drop(self._newer(step, this_world=True), "the step resumed from")  # listed again under the lease

    def _newer(self, step: int | None, *, this_world: bool) -> list[tuple[LocalStorage, int]]:
        """The committed steps of this rank's local tier and replicas newer than `step` (None: all), saved at this
        world size (`this_world`) or at another one."""
        found = []
        for root in [self.local, *self.replicas()]:
            restorable = set(self._restorable(root))
            found += [
                (root, s)
                for s in layout.committed_steps(root)
                if (step is None or s > step) and (s in restorable) == this_world
            ]
        return found

    def _drop(self, steps: list[tuple[LocalStorage, int]], than: str) -> None:
        """Delete `steps` (root, step) of this rank's local tier and replicas, each newer than `than` (words)."""
        for root, s in steps:
            if layout.is_committed(root, s):
                log.warning("step %d of %s is newer than %s: deleted", s, root.url, than)
                catalog.delete_step(root, s)
                if root is self.local and self.on_local_delete is not None:
                    self.on_local_delete(s)

    def delete_local(self, step: int) -> None:
        """Delete `step` from this rank's local tier, now (manifest first)."""
        self.take_lease()
        catalog.delete_step(self.local, step)
        if self.on_local_delete is not None:
            self.on_local_delete(step)

    def set_aside(
        self, source: Source, error: CorruptCheckpointError, own: BaseException | None, lease: lease_mod.Lease | None
    ) -> str:
        """A damaged local step is moved aside by each rank whose own copy is damaged; a durable one by rank 0."""
        if source.tier != LOCAL:
            return set_aside_durable(self.durable, self.ranks, source.step, error, lease)
        if not isinstance(own, CorruptCheckpointError) or not layout.is_committed(self.local, source.step):
            return "another rank's local copy is damaged"
        try:
            self.take_lease()
            return f"quarantined to {catalog.quarantine(self.local, source.step, str(error))}"
        except (LeaseHeldError, OSError) as e:
            return f"could not be quarantined ({e})"

    def taken(self, step: int) -> Storage | None:
        """The tier `step` is committed in, either (the tiers never hold two states of one step): this rank's local
        tier, and on rank 0 the durable root (the save's first message tells the others). The durable root is
        listed once: only this writer, which holds its lease, adds steps to it, and only steps it saved, so a step
        above the newest found then and every step saved since needs no read there (a save's stall holds no round
        trip to an object store)."""
        if layout.is_committed(self.local, step):
            return self.local
        if not self.ranks.leader:
            return None
        if self._durable_above is None:
            self._durable_above = max(layout.step_dirs(self.durable), default=-1)
        if step > self._durable_above:
            self._durable_above = step
            return None
        return self.durable if layout.is_committed(self.durable, step) else None

    # -- after a local commit (the writer thread) ---------------------------------------------------

    def committed(
        self,
        plan: WritePlan,
        durable_lease: lease_mod.Lease | None,
        done: Persisted,
        persist: bool | None = None,
    ) -> bool:
        """A step committed locally on every rank: queue its persist if it is the K-th since the last persist
        (`persist_every` may change between saves: a retuned K) or `persist` says so, replicate it to the peer, apply local retention.
        `done(step, error, seconds, bytes copied)` is called on the persist thread when a persist ends (bytes None: the
        step was durable already); the durable root's retention waits for it (returns False)."""
        step = plan.step
        assert plan.durable is not None  # a private root's plan carries the shared root's
        self._newest = (step, {name: plan.boxes[name] for name in plan.designated}, plan.durable)
        self._unpersisted += 1
        if persist or (persist is None and self._unpersisted >= self.persist_every):
            self._queue_persist(durable_lease, done)
        if self.offset:
            world, rank = self.ranks.world_size, self.ranks.rank
            source = (rank - self.offset) % world
            t0 = time.perf_counter()
            done = transfer(
                self.ranks,
                step,
                send_to=(rank + self.offset) % world,
                source=self.local,
                recv_from=source,
                dest=self.replica(source),
            )
            log.info(
                "replicated step %d: sent to rank %d, %d bytes of rank %d's kept, in %.3f s "
                "(%.3f s of it waiting for the peers)",
                step,
                (rank + self.offset) % world,
                done.received,
                source,
                time.perf_counter() - t0,
                done.waited,
            )
            self._retain(self.replica(source), {step})
        self._retain(self.local, self.persisting() | {step})
        return False

    def persist(self, step: int, durable_lease: lease_mod.Lease | None, done: Persisted) -> bool:
        """Persist `step`, the newest local commit, unless its persist was queued already and did not fail (False
        then); a ValueError for another step: only the newest one's plan is kept. A failed persist is started again:
        its error was raised already, and a retry is the only way left to make the step durable."""
        newest = None if self._newest is None else self._newest[0]
        if newest != step:
            raise ValueError(
                f"persist({step}): only this manager's newest save can be persisted, and that is step {newest} "
                f"(a step saved before it, or restored, is not in its plan)"
            )
        queued = self._persisting
        if queued is not None and queued[0] == step and not (queued[1].done() and queued[1].result() is False):
            return False
        self._queue_persist(durable_lease, done)
        return True

    def _queue_persist(self, durable_lease: lease_mod.Lease | None, done: Persisted) -> None:
        """Queue the persist of the newest local commit (one at a time: a slower durable tier holds the caller back)."""
        assert self._newest is not None
        self._unpersisted = 0
        step, regions, shared = self._newest
        if self._persisting is not None:
            futures_wait([self._persisting[1]])
        future = submit_or_run(self._persister, self._persist, step, regions, shared, durable_lease, done)
        self._persisting = (step, future)

    def persisting(self) -> set[int]:
        """The step whose persist is queued or running, if any."""
        return {self._persisting[0]} if self._persisting is not None and not self._persisting[1].done() else set()

    def _persist(
        self,
        step: int,
        regions: dict[str, Box],
        shared: ArrayPlan,
        lease: lease_mod.Lease | None,
        done: Persisted,
    ) -> bool:
        """Copy `step` to the durable root and tell `done`; returns whether it is durable (False: it failed, alike on
        every rank)."""
        t0 = time.perf_counter()
        try:
            copied = PersistJob(self.local, self.durable, step, regions, shared, self._persist_ranks, lease).run()
        except BaseException as e:
            log.error("persisting step %d to %s failed: %s", step, self.durable.url, e)
            done(step, e, time.perf_counter() - t0, None)
            return False
        seconds = time.perf_counter() - t0
        if copied is None:
            log.warning("step %d is already in the durable tier %s: not persisted again", step, self.durable.url)
        else:
            log.info("persisted step %d to %s: %.1f MB in %.2fs", step, self.durable.url, copied / 1e6, seconds)
        done(step, None, seconds, copied)
        return True

    def _retain(self, storage: Storage, protected: set[int]) -> None:
        """Delete the committed steps of a local root the local retention does not keep: never the newest, nor a
        step of `protected` (the one just committed, one being persisted). A failure (a policy that raises) is logged,
        as the durable root's retention does: the save it follows is committed, a step left behind loses nothing."""
        try:
            steps = layout.committed_steps(storage)
            metadata = StepMetadata(steps, functools.partial(layout.saved_metadata, storage), {})
            for s in doomed(self.retention, steps, metadata, spare=protected):
                catalog.delete_step(storage, s)
                if storage is self.local and self.on_local_delete is not None:
                    self.on_local_delete(s)
        except Exception as e:
            log.warning("local retention in %s failed: %s", storage.url, e)

    def wait(self) -> None:
        """Until the persist in flight, if any, has ended."""
        if self._persisting is not None:
            futures_wait([self._persisting[1]])

    def close(self) -> None:
        """Wait for the persist in flight, stop its thread, release this rank's local tier and the persists' group."""
        self.wait()
        self._persister.shutdown(wait=True)
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self._persist_ranks is not self.ranks:
            self._persist_ranks.close()

    # -- restoring ----------------------------------------------------------------------------------

    def inventory(self) -> dict:
        """What this rank holds: its local tier's committed steps and those of each replica it keeps; nothing
        when the local tier is another run's (`other_run`: a run never resumes another's steps)."""
        other = self.other_run()
        if other is not None:
            local, durable = other
            log.warning(
                "the local tier %s belongs to %s, the durable root %s to %s: its steps are not restored",
                self.local.url,
                local,
                self.durable.url,
                f"run {durable.id!r}" if durable is not None else "no run",
            )
            return {"local": [], "replica": {}, "other_run": True}
        return {
            "local": self._restorable(self.local),
            "replica": {str(r): self._restorable(self.replica(r)) for r in layout.replica_ranks(self.local)},
        }

    def _restorable(self, storage: Storage) -> list[int]:
        """Committed steps of a local root saved at this world size: a rank's local copy holds only the regions it
        held then, so after a change of world size the durable tier is read (a damaged manifest is left in, so
        that the restore reports it)."""
        steps = []
        for s in layout.committed_steps(storage):
            try:
                world = layout.read_manifest(storage, s).world_size
            except CorruptCheckpointError:
                world = self.ranks.world_size
            except StepNotFoundError:
                continue
            if world == self.ranks.world_size:
                steps.append(s)
        return steps

    def sources(self, durable: list[int]) -> list[Source]:
        """The restore order every rank agrees on (rank 0's view of the durable root, every rank's inventory)."""
        inventories = self.ranks.all_gather_json(self.inventory())
        return restore_order(durable, inventories)

    def heal(self, source: Source) -> CorruptCheckpointError | None:
        """Bring back the local copies `source` says are lost, each from the rank holding its replica, one pair
        at a time in rank order (every rank walks the same pairs). Returns this rank's failure, if any."""
        error = None
        me = self.ranks.rank
        for rank, holder in sorted(source.heal.items()):
            if me not in (rank, holder):
                continue
            try:
                if me == holder:
                    transfer(self.ranks, source.step, send_to=rank, source=self.replica(rank))
                else:
                    self.take_lease()
                    got = transfer(self.ranks, source.step, recv_from=holder, dest=self.local).received
                    log.warning(
                        "step %d was missing from this rank's local tier: %d bytes back from rank %d's replica",
                        source.step,
                        got,
                        holder,
                    )
            except Exception as e:
                error = CorruptCheckpointError(
                    f"could not bring back rank {rank}'s local copy from rank {holder}: {described(e)}",
                    step=source.step,
                )
        return error

    def steps(self, durable: Iterable[int]) -> list[Step]:
        """This rank's committed steps in either tier, ascending, each with its tiers (none of another run's local
        tier)."""
        local = set(layout.committed_steps(self.local)) if self.other_run() is None else set()
        durable = set(durable)
        return [
            Step(s, [t for t, held in ((LOCAL, s in local), (DURABLE, s in durable)) if held])
            for s in sorted(local | durable)
        ]
