"""CheckpointManager: the policy — when a save runs, which step a restore takes, what is kept."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
import weakref
from datetime import timedelta
from typing import Any, Mapping, Sequence

from . import catalog, fallback, layout
from . import restore as restore_mod
from . import run as run_mod
from . import snapshot as snapshot_mod
from . import state as state_mod
from .background import Background, SaveHandle
from .budget import WriteBudget
from .distributed import Ranks, local_box
from .errors import (
    CheckpointWriteError,
    CollectiveTimeout,
    CorruptCheckpointError,
    StepExistsError,
    StepNotFoundError,
)
from .observer import NO_TRACKER, CheckpointObserver, check_observer, tell_deleted, tell_run_id
from .options import RootOptions, TierOptions, WriteOptions, resolve
from .planner import Planner
from .retention import RetentionPolicy, StepMetadata, doomed, policy_of
from .root_lease import RootLease
from .save import SaveJob, plan
from .storage import Storage, context, open_storage
from .target import DURABLE, LOCAL, PEER, SingleRoot, Step, Target
from .tiers import Tiers

log = logging.getLogger("ckpt")


def _span_of(manager: "weakref.ref[CheckpointManager]", category: str, **attrs: Any) -> Any:
    """The manager's tracker's span, for its background threads (through a weak reference: the manager and its
    background would otherwise keep each other alive, and the root's lease with them, until the collector ran)."""
    m = manager()
    return (m._tracker if m is not None else NO_TRACKER).span(category, **attrs)


class CheckpointManager:
    """Saves training state asynchronously to `root` and restores the newest intact step.

    Args:
        root: local directory or URL (``file://``, ``memory://``, or any tensorstore kvstore URL), or a `Storage`
            (a backend of your own: see docs/architecture.md).
        retention: which committed steps to keep after each save (a `RetentionPolicy`: `KeepLast(3)`,
            ``Keep(KeepEvery(1000), KeepBest(2, "loss"))``, ...); default: all. The newest is never deleted.
        keep_last, keep_every, keep_best, best_metric, best_mode: shorthands for `KeepLast`, `KeepEvery` and
            `KeepBest`, kept together (`Keep`) when several are given; not together with `retention`.
        tracker: a `CheckpointObserver` (such as `ettr.GoodputTracker`) told about saves and restores.
        write: how a save writes, a `WriteOptions` (snapshot mode, chunk and pack sizes, staging cap, write
            budget, restore threads); its fields are also keywords here: ``snapshot="overlap"``, ``chunk_bytes=``,
            ``pack_bytes=``, ``max_staging_bytes=``, ``write_budget=``, ``io_threads=``. The default snapshot,
            ``"sync"``, copies every tensor inside `save`, so a checkpoint holds exactly the state at `save`;
            read `WriteOptions` before opting into ``"overlap"``.
        tiers: a fast local tier, a `TierOptions` (its fields as keywords: ``local=``, ``persist_every=``,
            ``keep_local=``, ``local_retention=``, ``replica_offset=``): every save commits to the local directory
            and every K-th is persisted to `root` in the background; `retention` applies to `root`.
        root_options: a `RootOptions` (as keywords: ``storage_options=``, ``lease_ttl=``, ``run_id=``,
            ``collective_timeout=``): object-store settings, the writer's lease, the run's id, how long a rank
            waits for the others.
        alone: this process checkpoints by itself even with torch.distributed initialized: no gloo group, no
            collective, world size 1 (the whole state is written and read here). For state every rank holds
            identically that one rank saves while the others only read it (Lightning's DDP: its `CheckpointIO`
            saves on rank 0 alone); the other ranks must never save or delete into the root. Each restores on its
            own, with no verdict shared: one that meets a damaged step sets it aside as a single process does (under
            the root's lease, so one rank moves it; Lightning restores a named step, which refuses instead).

    With torch.distributed initialized, every rank creates the manager (it makes a gloo group for its
    own collectives) and calls `save`/`restore` with the same step: each rank writes only its slices.
    """

    def __init__(
        self,
        root: str | os.PathLike | Storage,
        *,
        retention: RetentionPolicy | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        tracker: CheckpointObserver | None = None,
        write: WriteOptions | None = None,
        tiers: TierOptions | None = None,
        root_options: RootOptions | None = None,
        snapshot: str | None = None,
        chunk_bytes: int | None = None,
        pack_bytes: int | None = None,
        max_staging_bytes: int | None = None,
        write_budget: WriteBudget | float | None = None,
        io_threads: int | None = None,
        local: str | os.PathLike | None = None,
        persist_every: int | None = None,
        keep_local: int | None = None,
        local_retention: RetentionPolicy | None = None,
        replica_offset: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        lease_ttl: float | None = None,
        run_id: str | None = None,
        collective_timeout: float | None = None,
        alone: bool = False,
    ):
        if type(alone) is not bool:
            raise TypeError(f"alone must be True or False, got {alone!r}")
        self.write, tiering, reach = resolve(
            write,
            tiers,
            root_options,
            snapshot=snapshot,
            chunk_bytes=chunk_bytes,
            pack_bytes=pack_bytes,
            max_staging_bytes=max_staging_bytes,
            write_budget=write_budget,
            io_threads=io_threads,
            local=local,
            persist_every=persist_every,
            keep_local=keep_local,
            local_retention=local_retention,
            replica_offset=replica_offset,
            storage_options=storage_options,
            lease_ttl=lease_ttl,
            run_id=run_id,
            collective_timeout=collective_timeout,
        )
        self.retention = policy_of(retention, keep_last, keep_every, keep_best, best_metric, best_mode)
        self.storage: Storage = open_storage(root, reach.storage_options)
        self.storage.check_creatable()  # here, not at the first save an hour into the run
        layout.check_not_a_step(self.storage)
        self.run = run_mod.Run.current(reach.run_id)
        self._run_recorded = False
        self._tracker: CheckpointObserver = NO_TRACKER
        self._budget = self.write.budget
        self._write_context = self._budget.context(context())
        self._background = Background(
            self._budget,
            io_threads=self.write.io_threads,
            max_staging_bytes=self.write.max_staging_bytes,
            span=functools.partial(_span_of, weakref.ref(self)),  # no cycle: a dropped manager is freed at once
        )
        self.tracker = tracker
        timeout = timedelta(seconds=reach.collective_timeout)
        self.ranks: Ranks = Ranks.local() if alone else Ranks.current(timeout)
        self._metadata: dict[int, dict[str, Any]] = {}
        self._root_lease = RootLease(self.storage, self.ranks, reach.lease_ttl)  # taken by the first save
        self._planner = Planner()  # the arrays of the last save, reused while the state keeps its structure
        self._target: Target = SingleRoot(self.storage, self.ranks)
        if tiering is not None:
            # every rank's local tier records the run the durable root records: rank 0's (a generated id is per process)
            self.run = run_mod.Run(**self.ranks.broadcast_json(dataclasses.asdict(self.run)))
            tell_run_id(self._tracker, self.run.id)
            self._target = Tiers(self.storage, tiering, self.ranks, timeout)
            self._target.on_local_delete = lambda step: tell_deleted(self.tracker, step, tier=LOCAL)
        self._closed = False
        self._released = False  # `close` finished releasing threads and leases

    @property
    def snapshot(self) -> str:
        """The snapshot mode, ``"sync"`` or ``"overlap"`` (`WriteOptions.snapshot`)."""
        return self.write.snapshot

    @property
    def local_root(self) -> str | None:
        """This rank's local tier's directory (``local=``, its ``{rank}`` filled in); None without a local tier."""
        return self._target.local_root

    @property
    def persist_every(self) -> int | None:
        """With a local tier, every how many saves one is persisted to the durable root (settable: a retuned K)."""
        return self._target.persist_every

    @persist_every.setter
    def persist_every(self, k: int) -> None:
        self._target.persist_every = k

    @property
    def tracker(self) -> CheckpointObserver:
        """Told about saves and restores; never None (assigning None, as Lightning does, installs a no-op one)."""
        return self._tracker

    @tracker.setter
    def tracker(self, tracker: CheckpointObserver | None) -> None:
        self._tracker = NO_TRACKER if check_observer(tracker) is None else tracker
        tell_run_id(self._tracker, self.run.id)

    # -- saving -------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        persist: bool | None = None,
    ) -> SaveHandle:
        """Snapshot `state` into host memory and write it in the background; returns once the snapshot is taken.

        A save still writing is waited for first (never two interleaved). An error of an earlier background write is
        raised here, before anything new is written. The first save takes the root's lease (one writer per root):
        `LeaseHeldError` names the live writer holding it.

        With a local tier, `persist=True` also persists this step to the durable root (a job's last save, one before
        a preemption: the node may not come back), `False` never; by default every `persist_every`-th save is.
        """
        self._check_open()
        bg = self._background
        with self.tracker.span("checkpoint_save", step=step):
            first = not self._root_lease.agreed
            if first:  # the lease's first take is a collective of its own: a refusal reaches every rank from it
                self._root_lease.take(collective=True)
            failure = None  # among ranks, a rank that cannot save tells the others in the plan's first message
            try:
                bg.raise_error()
                if bg.inflight is not None and not bg.inflight.done():  # a part of the save's time, told apart
                    with self.tracker.span("checkpoint_save", step=step, part="previous_wait"):
                        bg.drain()
                bg.drain()
                if not first:
                    self._root_lease.take(collective=True)  # rank 0 checks it still holds the lease
                bg.wait_delete(step)  # a delete of this very step number must finish before it is written again
                target, lease = self._target.writable(self._root_lease.lease)
                taken = self._target.taken(step)
                if taken is not None:
                    layout.check_step_free(taken, step)  # a symbolic link there reads as committed: say it is one
                    raise StepExistsError(
                        f"step {step} is already committed in {taken.url}; a committed checkpoint is never overwritten"
                    )
            except Exception as e:
                failure = self._to_tell(e)
            t0 = time.perf_counter()
            owned = snapshot_mod.optimizer_owned(state) if self.snapshot == "overlap" and failure is None else {}
            w = self.write
            written = plan(
                step,
                state,
                metadata,
                w.chunk_bytes,
                self.ranks,
                self._planner,
                w.pack_bytes,
                private=self._target.private,
                failure=failure,
                persist=persist,
            )
            defer = snapshot_mod.versions(written.tensors, owned)
            job = SaveJob(target, written, bg.arena, self._write_context, self.ranks, lease, bg.fsyncs, defer=defer)
            if job.pending is not None:
                bg.start_snapshot(job.pending)
            stall = time.perf_counter() - t0

        def failed(err: CheckpointWriteError) -> None:
            with contextlib.suppress(Exception):
                job.abandon()
            self.tracker.checkpoint_failed(step, err)

        return bg.submit_save(
            step,
            lambda: self._commit(job, stall, persist),
            failed=failed,
            then=lambda retain_now: self._retain_after(step) if retain_now else None,
            pending=job.pending,
        )

    def persist(self, step: int) -> bool:
        """With a local tier, persist `step`, this manager's newest save, to the durable root now unless it was (a save
        that turned out to be the job's last, or the one before a preemption: the node may not come back); True if a
        persist started. Waits for that save's local commit, then returns; `wait()` waits for the persist. A persist
        of it that failed (its error raised already) is started again. Among ranks call it on every rank. With one
        root a committed step is durable already: False."""
        self._check_open()
        layout.step_dir(step)  # a ValueError for a step that is not a non-negative int
        bg = self._background
        bg.drain()  # the step's local commit: its plan is known once it is done
        bg.raise_error()
        return self._target.persist(step, self._root_lease.lease, self._persisted)

    def _to_tell(self, error: Exception) -> Exception:
        """An error met before a save's or restore's first message among the ranks, which tells it to every rank;
        raised here alone, or once a message among the ranks timed out (they are out of step: another would only
        wait again and hide this error)."""
        if self.ranks.world_size == 1 or any(isinstance(e, CollectiveTimeout) for e in (error, error.__cause__)):
            raise error
        return error

    def _commit(self, job: SaveJob, stall: float, persist: bool | None) -> bool:
        """Writer thread: record the run once, write and commit, tell the target (a local tier replicates and
        persists); returns whether the durable root's retention runs now."""
        step, t0 = job.plan.step, time.perf_counter()
        tiered = job.storage is not self.storage
        if not self._run_recorded:  # the root that commits records the run before any step of it commits there
            if tiered:
                run_mod.claim(job.storage, self.run, durable=self.storage.url)
            elif self.ranks.leader:
                run_mod.claim(self.storage, self.run)
        self._budget.lower_pool_threads()
        job.run()
        if not self._run_recorded:
            if tiered and self.ranks.leader:  # after every rank's local tier recorded it (job.run's messages)
                run_mod.claim(self.storage, self.run)
            self._run_recorded = True
            self._remove_leftovers(job)
        retain_now = self._target.committed(job.plan, self._root_lease.lease, self._persisted, persist)
        self._budget.lower_pool_threads()  # workers tensorstore started during this write
        seconds, nbytes = time.perf_counter() - t0, sum(t.nbytes for t in job.plan.tensors.values())  # this rank's
        if self.retention is not None and self.ranks.leader:  # the durable retention's cache (`_retain_after`)
            self._metadata[step] = job.plan.metadata
        mb, rate = nbytes / 1e6, nbytes / max(seconds, 1e-9) / 1e9
        log.info(
            "committed step %d: %.1f MB, stall %.3fs, background %.3fs (%.2f GB/s)", step, mb, stall, seconds, rate
        )
        tier = self._target.commit_tier  # one tier: no tier=, as observers written for one tier expect
        self._tell_committed(step, seconds, nbytes, **({"tier": tier} if tier else {}))
        return retain_now

    def _tell_committed(self, step: int, seconds: float, nbytes: int, **tier: str) -> None:
        """Tell the tracker a step is committed; its own failure (a ledger it cannot write) is logged: the step is
        durable, and a save reported failed after its commit would be retried into `StepExistsError`."""
        try:
            self.tracker.checkpoint_committed(step, seconds, nbytes, **tier)
        except Exception as e:
            log.warning("step %d is committed, but the tracker could not record it: %s", step, e)

    def _persisted(
        self, step: int, error: BaseException | None, seconds: float = 0.0, nbytes: int | None = None
    ) -> None:
        """Persist thread: a persist ended; its error is raised by the next call, else the tracker hears of the durable
        commit (`nbytes` copied in `seconds`; None: the step was durable already) and the durable tier's retention runs."""
        if error is not None:
            err = CheckpointWriteError(step, RuntimeError(f"persisting to {self.storage.url}: {error}"))
            self._background.fail(err, unless_failed=True)
            return
        if nbytes is not None:
            self._tell_committed(step, seconds, nbytes, tier=DURABLE)
        self._retain_after(step)

    def _retain_after(self, step: int) -> None:
        """Queue the deletion of the committed steps the policy does not keep; never the newest, whatever it says, nor
        `step`, the one just committed (or persisted). Forgets the cached metadata of older local steps never persisted:
        a long run's cache holds the durable root's steps, not every save. A checkpoint left behind is no data loss: a
        failure is reported, not raised."""
        if self.retention is None or not self.ranks.leader:
            return
        try:
            self._check_lease()  # a writer that lost the root lists nothing: the steps are its successor's now
            steps = layout.committed_steps(self.storage)
            for s in [s for s in self._metadata if s < step and s not in steps]:  # a local step never persisted
                del self._metadata[s]
            read = functools.partial(layout.saved_metadata, self.storage)
            for s in doomed(self.retention, steps, StepMetadata(steps, read, self._metadata), spare={step}):
                self._queue_delete(s, report=False)
        except Exception as e:
            log.warning("retention after step %d failed: %s", step, e)

    def _remove_leftovers(self, job: SaveJob) -> None:
        """Writer thread, once the roots are this run's (its first commit): delete what earlier processes' kills left
        in them (a save's partial step, a step whose delete a kill interrupted), so that no disk stays taken until a
        `ckpt gc`. Each root by the rank holding its exclusive lease (`catalog.collect_leftovers`): the root this save
        committed to (with a local tier, each rank's own, and the peer replicas in it: a kill during a replica's
        receive leaves one half written), and the durable root by the leader. Before the save's handle is done, so
        nothing of it outlives a manager dropped after `wait()`; a failure is only logged."""
        roots = [(job.storage, job.lease)] + [(replica, job.lease) for replica in self._target.replicas()]
        if job.storage is not self.storage and self.ranks.leader:
            roots.append((self.storage, self._root_lease.lease))
        for storage, held in roots:
            try:
                removed = [] if held is None else catalog.collect_leftovers(storage, held)
            except Exception as e:
                log.warning("could not remove the leftovers of crashed saves or deletes in %s: %s", storage.url, e)
                continue
            if removed:
                log.info("removed the leftovers of crashed saves or deletes in %s: steps %s", storage.url, removed)

    def _check_lease(self) -> None:
        """Raise `LeaseHeldError` unless this process still holds the durable root's lease (where it took one)."""
        if self._root_lease.lease is not None:
            self._root_lease.lease.check()

    def _queue_delete(self, step: int, *, report: bool) -> None:
        """Delete a committed step of the durable root (manifest first) on the deleter thread."""

        def delete() -> None:
            self._check_lease()  # checked again here: a delete queued before the writer lost the root deletes nothing
            catalog.delete_step(self.storage, step)
            self._metadata.pop(step, None)
            tell_deleted(self.tracker, step, tier=DURABLE if self._target.commit_tier else None)

        self._background.queue_delete(step, delete, report=report)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.storage.url!r}) is closed")

    def wait(self) -> None:
        """Block until every save in flight is committed and every delete done; raises a background error, if any.
        Among ranks the deletes are rank 0's (retention's too): another rank does not wait for them."""
        bg = self._background
        bg.drain()
        if not self._closed:
            bg.barrier()  # retention of the last commit has queued its deletes
        self._target.wait()  # the persist in flight, and the durable retention it queued
        bg.wait_deletes()
        bg.raise_error()

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Allocate and pre-fault the host snapshot buffer for `state` in the background, so that the next save
        copies into warm memory (a first save into fresh pages stalls ~10x longer). Returns at once.

        `restore` does it by itself, also on a fresh start, sized from the state it was given; call this once the
        state has its full size, e.g. after the first optimizer step (an optimizer's state appears there).
        """
        self._check_open()
        sizes = [local_box(t)[0].nbytes for t in state_mod.flatten(state, rank=self.ranks.rank).tensors.values()]
        self._background.reserve(sizes, warm_snapshot=self.snapshot == "overlap")

    def hold_lease(self, *, collective: bool = True) -> None:
        """Take the root's writer lease now, as the first save would (among ranks a collective: call it on every rank).

        For a writer that trains before its first save, such as a training loop: a second writer of the root fails
        here with `LeaseHeldError`, naming the live one, instead of an interval of training later. Held until
        `close`. ``collective=False``: rank 0 alone takes it (another rank does nothing), for what rank 0 writes by
        itself before the ranks meet again (deleting an earlier run at a start-over); a later collective call, or the
        first save, lets every rank know."""
        self._check_open()
        if not self._root_lease.agreed:
            self._root_lease.take(collective=collective)

    # -- restoring ----------------------------------------------------------------------------------

    def restore(
        self,
        state: dict[str, Any],
        *,
        step: int | None = None,
        keys: Sequence[str] | None = None,
        rank_map: str = "modulo",
        track: bool = True,
    ) -> int | None:
        """Load the newest intact committed step (or `step`) into `state` in place; returns the step or None.

        Nothing reaches `state` unless every read of the step verified: a failed restore leaves it as it was. Without
        `step`, a damaged checkpoint is reported (warning), moved aside to ``ROOT/_quarantine/`` (so that training can
        save that step again) and the previous one is tried; a step deleted while being read (another process's
        retention) is no damage: the steps are listed again. All ranks agree on the step. `keys` restricts the restore
        to some top-level entries of the state (e.g. ``["model"]``); without it, the state and the checkpoint must
        have the same keys. Per-rank entries (RNG) saved at another world size go to rank i from rank
        ``i % saved_world_size`` (``rank_map="modulo"``, the default) or are left as they are (``"skip"``: the
        caller reseeds). `track=False` keeps the restore from the tracker: a load for evaluation is not a resume.

        With a local tier (``local=``) the newest intact step of either tier is taken, the local tier first for the
        same step; a rank whose local copy is lost gets it back from its peer's replica first, and a damaged local
        step falls back to the durable tier. The tier read from is logged and told to the tracker; local steps newer
        than the one a resume takes (an attempt killed before every rank had them) are deleted.
        """
        if rank_map not in ("modulo", "skip"):
            raise ValueError(f"rank_map must be 'modulo' or 'skip', got {rank_map!r}")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of the objects to restore into, got {type(state).__name__}")
        if isinstance(keys, str):
            raise TypeError(f"keys must be a list of top-level keys, e.g. [{keys!r}], not a str")
        keys = None if keys is None else list(keys)  # read once: each step tried (and each rank's plan) reads it
        if keys == []:  # a filter that emptied: resuming at the step with nothing loaded would train from scratch
            raise ValueError("restore(keys=[]) would restore nothing and return a step; keys=None restores every key")
        self._check_open()
        failure = None  # among ranks, told to every rank by the restore's first message
        try:
            self.wait()
        except Exception as e:
            failure = self._to_tell(e)
        tracker = self.tracker if track else NO_TRACKER
        bg, tier = self._background, None
        with tracker.span("checkpoint_restore"):
            t0 = time.perf_counter()

            def read(storage: Storage, s: int) -> Any:  # the durable root is every rank's: shared regions read once
                args = (state, keys, self.ranks, rank_map, bg.readers, bg.arena)
                return restore_mod.read_step(storage, s, *args, shared=storage is self.storage)

            found = fallback.walk(
                self.storage, self._target, self.ranks, step, read, self._root_lease.lease, failure, keys
            )
            source, plan = found.source, found.plan
            if source is not None and plan is not None:
                restore_mod.apply(plan, state)
                if track:  # where the job resumes: may the durable tier lag behind?
                    self._target.resumed(source, found.remaining)
                tier = PEER if self.ranks.rank in source.heal else source.tier
                sizes = [r.nbytes for r in plan.reads.values()]
                url, mb, seconds = self._target.storage_of(source).url, sum(sizes) / 1e6, time.perf_counter() - t0
                log.info("restored step %d from %s (%s tier): %.1f MB in %.2fs", source.step, url, tier, mb, seconds)
                if keys is None:  # the arena now holds what was read; grow it to the whole state in the background
                    bg.reserve(sizes, warm_snapshot=self.snapshot == "overlap")
            elif keys is None:  # a fresh start: the first save should not fault in its arena
                try:
                    self.reserve(state)
                except (TypeError, ValueError) as e:  # a state `save` would refuse: the save says so, naming the key
                    log.debug("no staging reserved ahead of the first save: %s", e)
        restored = None if source is None else source.step
        if track and step is None:  # the job resumes from the newest step it could: nothing newer may stay in its way
            self._target.left_behind(restored)
        if found.damaged and restored is not None:
            log.warning("restored step %d after skipping %d damaged step(s)", restored, len(found.damaged))
        tracker.checkpoint_restored(restored, tier=tier if self._target.commit_tier else None)  # one tier: None
        return restored

    # -- queries and lifetime -----------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """Committed steps, ascending (a step queued for deletion is no longer listed); each is an int whose
        `tiers` says where it is: ``("durable",)`` without a local tier, else ``"local"``, ``"durable"`` or both."""
        deleting = self._background.deleting()
        return self._target.steps([s for s in layout.committed_steps(self.storage) if s not in deleting])

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return (self.steps() or [None])[-1]

    def delete(self, step: int) -> None:
        """Delete a committed step in the background (manifest first); never the newest committed one, nor one
        still being written or persisted (a `ValueError`). Returns at once; `steps()` stops listing it; an error is
        raised by the next call.
        Among ranks the shared root has one writer: rank 0's call deletes the step there, another rank's checks it
        and deletes only its own local tier's copy (call it on every rank, or on rank 0); to another rank a step no
        longer listed is one rank 0 deleted first, not an error."""
        self._check_open()
        layout.step_dir(step)  # a ValueError for a step that is not a non-negative int
        self._background.raise_error()
        if self._background.writing(step):
            raise ValueError(f"step {step} is still being written")
        if step in self._target.persisting():  # its local copy is being read, its durable one not committed yet
            raise ValueError(f"step {step} is still being persisted to {self.storage.url}: delete it after wait()")
        committed = self.steps()
        if step not in committed:
            if not self.ranks.leader:
                return  # rank 0's call of the same delete ran first (or, for a step never committed, raises there)
            raise StepNotFoundError(
                f"step {step} is not a committed step of {self.storage.url} (committed: {committed})"
            )
        if step == committed[-1]:
            raise ValueError(f"step {step} is the newest committed step; it is never deleted")
        tiers = committed[committed.index(step)].tiers
        if LOCAL in tiers:
            self._target.delete_local(step)
        if DURABLE in tiers and self.ranks.leader:
            self._root_lease.take(collective=False)
            self._queue_delete(step, report=True)

    def metadata(self, step: int) -> dict[str, Any]:
        """The user metadata saved with a committed step (from the local tier when it holds the step, from the durable
        copy when the local manifest is damaged)."""
        damaged: CorruptCheckpointError | None = None
        for root in self._target.metadata_roots(step):
            try:
                return layout.read_manifest(root, step).metadata
            except CorruptCheckpointError as e:
                damaged = damaged or e
            except StepNotFoundError:
                if damaged is None:
                    raise
        assert damaged is not None
        raise damaged

    def close(self) -> None:
        """Drain writes (raising a background error, if any), release threads and the root's lease. Each release is
        made whatever the one before raised (a second Ctrl-C); a close that did not finish is finished by the next."""
        if self._released:
            return
        self._background.arena.closing()  # a reservation for a next save would only delay the close
        with contextlib.ExitStack() as releases:  # on the way out, last first, each whatever the one before raised
            releases.callback(self._root_lease.release)
            releases.callback(self._target.close)
            releases.callback(self._background.close)
            releases.callback(setattr, self, "_closed", True)
            if not self._closed:
                self.wait()
        self.ranks.close()  # last: every rank is past its last message of this manager
        self._released = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the loop's exception with a write error; still drain
            with contextlib.suppress(Exception):
                self.close()
