"""CheckpointManager: the policy — when a save runs, which step a restore takes, what is kept."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from typing import Any, ContextManager, Mapping, Protocol, Sequence

from . import catalog, layout
from . import lease as lease_mod
from . import restore as restore_mod
from . import run as run_mod
from . import snapshot as snapshot_mod
from . import state as state_mod
from .budget import WriteBudget, submit_or_run
from .distributed import Ranks, local_box, prepare_optimizers
from .errors import (
    CheckpointDeleteError,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    LeaseHeldError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
)
from .format import MAX_CHUNK_BYTES, PACK_BYTES
from .layout import read_manifest
from .retention import RetentionPolicy, StepMetadata, from_keywords
from .save import SaveJob, plan
from .staging import StagingArena
from .storage import Storage, context, open_storage
from .tiers import DURABLE, LOCAL, PEER, Source, Step, Tiers

log = logging.getLogger("ckpt")
_MAX_RELISTS = 100  # steps vanishing under a restore, in a row, before it gives up


class CheckpointObserver(Protocol):
    """What the manager tells a goodput tracker (e.g. `ettr.GoodputTracker`); every method must be thread-safe."""

    def span(self, category: str, **attrs: Any) -> ContextManager[Any]: ...
    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int, *, tier: str | None = None
    ) -> None: ...
    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None: ...
    def checkpoint_failed(self, step: int, error: BaseException) -> None: ...


class _NoTracker:
    def span(self, category: str, **attrs: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int, *, tier: str | None = None
    ) -> None:
        pass

    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None:
        pass

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        pass


_NO_TRACKER = _NoTracker()


class SaveHandle:
    """A save in flight: `done()` polls, `wait()` blocks until committed and raises its error, if any;
    `wait_snapshot()` blocks until its host snapshot is complete (the state may then change in any way)."""

    def __init__(
        self, step: int, future: Future, manager: "CheckpointManager", pending: snapshot_mod.Pending | None = None
    ):
        self.step, self._future, self._manager, self._pending = step, future, manager, pending

    def done(self) -> bool:
        return self._future.done()

    def wait_snapshot(self) -> None:
        """Wait until every tensor of this save is copied to host memory (timed as checkpoint_save).

        With ``snapshot="sync"`` (the default) `save` has copied everything already: this returns at once. With
        ``snapshot="overlap"`` an optimizer's `step()` does this by itself; call it before changing the
        parameters or optimizer state in place any other way (an EMA swap, ``p.data`` writes, a numpy view). It
        never raises: a failed save is raised by `wait()` or the manager's next call.
        """
        if self._pending is not None:  # else everything was copied inside save
            self._manager._await_snapshot(self._pending)

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.result(timeout)
        except CheckpointWriteError as e:
            self._manager._consume(e)
            raise


class CheckpointManager:
    """Saves training state asynchronously to `root` and restores the newest intact step.

    Args:
        root: local directory or URL (``file://``, ``memory://``, or any tensorstore kvstore URL).
        retention: which committed steps to keep after each save (a `RetentionPolicy`: `KeepLast(3)`,
            ``Keep(KeepEvery(1000), KeepBest(2, "loss"))``, ...); default: all. The newest is never deleted.
        keep_last, keep_every, keep_best, best_metric, best_mode: shorthands for `KeepLast`, `KeepEvery` and
            `KeepBest`, kept together (`Keep`) when several are given; not together with `retention`.
        max_staging_bytes: cap on the host snapshot buffer; larger states are snapshotted in waves.
        write_budget: what a background write may use of the machine: a `WriteBudget` (share of the CPUs,
            file operations per core, niceness of the write's threads) or a number, the share of the CPUs.
            Default `WriteBudget()`: half the cores, 2 file operations per core, threads at nice 10, so that
            training comes first when both want the CPU (docs/checkpointing.md, "Background writes and training").
        chunk_bytes: target size of one chunk file (one chunk per tensor up to this size; at most 4 GiB).
        pack_bytes: tensors of at most this size (and `chunk_bytes`) that a rank writes whole are packed into
            one byte array per rank instead of an array each: a model of many small tensors writes a few files
            per step, not thousands. 0: every tensor its own array.
        tracker: a `CheckpointObserver` (such as `ettr.GoodputTracker`) told about saves and restores.
        io_threads: concurrent chunk reads on restore.
        collective_timeout: seconds a rank waits for the others during a save or restore before failing.
        run_id: this run's id, recorded in ROOT/run.json by the first save (default: from the launcher's
            environment, else a new random id); see `ckpt.run`. Integrations compare it at a fresh start.
        local: a directory on this machine (NVMe, ``/dev/shm``) for a fast local tier: every save commits there,
            and `root` becomes the durable tier. ``{rank}`` in it is replaced by the rank (each rank needs its own).
        persist_every: with `local`, every K-th committed save (counted from this manager's start, or from its first
            save when `restore` took a local step the durable tier lacks: that save is persisted) is also persisted
            to `root` in the background, copied from the local tier's committed files (verified); `retention`
            applies to `root`.
        keep_local: with `local`, how many committed steps the local tier keeps.
        replica_offset: with `local` and torch.distributed, each rank's local step is also sent to the local tier
            of rank ``(rank + replica_offset) % world`` (default: the ranks per node, from LOCAL_WORLD_SIZE, else 1),
            so that a lost node's steps come back from its peer; 0: no replica.
        storage_options: object-store settings (endpoint, region, credentials, timeout...; see
            docs/object_stores.md); the standard AWS variables apply without them.
        lease_ttl: object stores: seconds after which a writer that stopped renewing its lease (a crash) loses
            it, so gc may clean its leftovers and another writer take the root; renewed every ttl/4.
        snapshot: ``"sync"`` (default): every tensor is copied to host memory inside `save`, so a checkpoint holds
            exactly the state at `save` whatever the code does next. ``"overlap"`` (opt-in: a shorter stall):
            the parameters and state tensors of the torch optimizers in a saved state are copied after `save`
            returns, beside the next forward and backward, and the next ``optimizer.step()`` waits for that copy
            (`ckpt.snapshot`). Its contract: between `save` and the next ``optimizer.step()`` nothing but that
            step writes those tensors, or `SaveHandle.wait_snapshot()` is called first. A write that bumps a
            version counter (``p.mul_()`` under ``no_grad``, ``load_state_dict``, the in-place renorm of
            ``nn.Embedding(max_norm=...)`` in forward) fails the save (`StateChangedError`) when it comes before
            the copy: a race. One that bumps none (through ``p.data``, a numpy view, an EMA swap through
            ``.data``, ``opt.state[p]["exp_avg"].data.zero_()``) is committed silently.

    With torch.distributed initialized, every rank creates the manager (it makes a gloo group for its
    own collectives) and calls `save`/`restore` with the same step: each rank writes only its slices.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        retention: RetentionPolicy | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        max_staging_bytes: int | None = None,
        write_budget: WriteBudget | float | None = None,
        chunk_bytes: int = 64 << 20,
        pack_bytes: int = PACK_BYTES,
        tracker: CheckpointObserver | None = None,
        io_threads: int = 8,
        collective_timeout: float = 600.0,
        run_id: str | None = None,
        local: str | os.PathLike | None = None,
        persist_every: int = 1,
        keep_local: int = 2,
        replica_offset: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        lease_ttl: float = lease_mod.TTL_S,
        snapshot: str = "sync",
    ):
        if snapshot not in snapshot_mod.MODES:
            raise ValueError(f"snapshot must be one of {snapshot_mod.MODES}, got {snapshot!r}")
        self.snapshot = snapshot
        if not lease_ttl > 0:
            raise ValueError(f"lease_ttl must be positive seconds, got {lease_ttl!r}")
        self.storage: Storage = open_storage(root, storage_options)
        self.lease_ttl = float(lease_ttl)
        self.run = run_mod.Run.current(run_id)
        self._run_recorded = False
        shorthand = from_keywords(keep_last, keep_every, keep_best, best_metric, best_mode)
        if retention is not None and shorthand is not None:
            raise ValueError("give retention= or the keep_last/keep_every/keep_best shorthands, not both")
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise TypeError(f"retention must be a RetentionPolicy (a keep(steps, metadata) method), got {retention!r}")
        self.retention: RetentionPolicy | None = retention if retention is not None else shorthand
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        if pack_bytes < 0:
            raise ValueError(f"pack_bytes must be >= 0, got {pack_bytes}")
        self.pack_bytes = pack_bytes
        self.tracker = tracker
        self._arena = StagingArena(max_staging_bytes)
        self.write_budget = WriteBudget.of(write_budget)
        self._write_context = self.write_budget.context(context())
        self.ranks: Ranks = Ranks.current(timedelta(seconds=collective_timeout))
        lower = self.write_budget.lower_this_thread  # background threads yield the CPU to training
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer", initializer=lower)
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-reader")
        self._deleter = ThreadPoolExecutor(1, "ckpt-deleter", initializer=lower)  # no save ever waits for it
        # the overlapped part of a snapshot: at training's priority, as an optimizer step may be waiting for it
        self._snapshotter = ThreadPoolExecutor(1, "ckpt-snapshot")
        self._pending: snapshot_mod.Pending | None = None  # the copies of the save in flight not yet made
        self._fence: snapshot_mod.Fence | None = None  # makes optimizer steps wait for them
        # fsyncs of the chunk files a save writes itself (a local root): they wait for the disk, side by side
        self._fsyncs = ThreadPoolExecutor(self.write_budget.threads()[1], "ckpt-fsync", initializer=lower)
        self._deleting: dict[int, Future] = {}
        self._inflight: SaveHandle | None = None
        self._error: CheckpointError | None = None
        self._lock = threading.Lock()
        self._metadata: dict[int, dict[str, Any]] = {}
        self._lease: lease_mod.Lease | None = None  # the root's lease (rank 0's), taken at the first save
        self._writer_agreed = False  # every rank knows the lease is held
        self.tiers: Tiers | None = None  # with local=: the local tier beside `root`, the durable one
        if local is not None:
            # every rank's local tier records the run the durable root records: rank 0's (a generated id is per process)
            self.run = run_mod.Run(**self.ranks.all_gather_json(dataclasses.asdict(self.run))[0])
            self.tiers = Tiers(
                self.storage,
                local,
                persist_every=persist_every,
                keep_local=keep_local,
                ranks=self.ranks,
                timeout=timedelta(seconds=collective_timeout),
                replica_offset=replica_offset,
            )
        self._closed = False

    @property
    def tracker(self) -> CheckpointObserver:
        """Told about saves and restores; never None (assigning None, as Lightning does, installs a no-op one)."""
        return self._tracker

    @tracker.setter
    def tracker(self, tracker: CheckpointObserver | None) -> None:
        self._tracker = tracker if tracker is not None else _NO_TRACKER

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

        A save still writing is waited for first (never two interleaved). An error of an earlier
        background write is raised here, before anything new is written. The first save takes the root's
        lease (one writer per root): `LeaseHeldError` names the live writer holding it.

        With a local tier, `persist=True` also persists this step to the durable root (the last save of a job, a
        save before a preemption: the node and its local tier may not come back), `False` never; by default
        every `persist_every`-th save is.
        """
        self._check_open()
        self._raise_error()
        with self.tracker.span("checkpoint_save", step=step):
            self._drain()
            self._take_lease(collective=True)
            pending = self._deleting.get(step)
            if pending is not None:  # a delete of this very step number must finish before it is written again
                futures_wait([pending])
            target, lease = (self.tiers.local, self.tiers.take_lease()) if self.tiers else (self.storage, self._lease)
            if layout.is_committed(target, step):
                raise StepExistsError(
                    f"step {step} is already committed in {target.url}; a committed checkpoint is never overwritten"
                )
            t0 = time.perf_counter()
            owned = snapshot_mod.optimizer_owned(state) if self.snapshot == "overlap" else set()
            written = plan(
                step, state, metadata, self.chunk_bytes, self.ranks, self.pack_bytes, private=self.tiers is not None
            )
            defer = snapshot_mod.versions(written.tensors, owned)
            job = SaveJob(
                target, written, self._arena, self._write_context, self.ranks, lease, self._fsyncs, defer=defer
            )
            if job.pending is not None:
                if self._fence is None:
                    self._fence = snapshot_mod.Fence(self._await_snapshot)
                self._snapshotter.submit(job.pending.run)
                self._pending = job.pending
            stall = time.perf_counter() - t0
        committed: Future = Future()
        self._writer.submit(self._background, job, stall, committed, persist)
        self._inflight = SaveHandle(step, committed, self, job.pending)
        return self._inflight

    def _await_snapshot(self, pending: snapshot_mod.Pending | None = None) -> None:
        """Wait for a save's overlapped copies (default: the save in flight's), timed as checkpoint_save; the fence
        of every optimizer step. Never raises: the save's error reaches the loop through the manager's calls."""
        pending = pending or self._pending
        if pending is None or pending.done():
            return
        t0 = time.perf_counter()
        with self.tracker.span("checkpoint_save", step=pending.step):
            pending.wait()
        log.debug(
            "waited %.3fs for the snapshot of step %d before changing its tensors",
            time.perf_counter() - t0,
            pending.step,
        )

    def _background(self, job: SaveJob, stall: float, committed: Future, persist: bool | None = None) -> None:
        """Record the run once, write and commit (resolving `committed`), then queue retention's deletes."""
        step, t0 = job.plan.step, time.perf_counter()
        try:
            if not self._run_recorded:
                for storage, writer in ((job.storage, job.leader), (self.storage, self.tiers and self.ranks.leader)):
                    if writer:
                        run_mod.claim(storage, self.run)
                self._run_recorded = True
            self.write_budget.lower_pool_threads()
            job.run()
            if self.tiers is not None:  # replicate to the peer, persist the K-th, local retention
                self.tiers.committed(job.plan, self._lease, self._persisted, persist)
            self.write_budget.lower_pool_threads()  # workers tensorstore started during this write
        except BaseException as e:
            err = CheckpointWriteError(step, e)
            with self._lock:
                self._error = err
            log.error("checkpoint step %d failed: %s", step, e)
            with contextlib.suppress(Exception):
                job.abandon()
            self.tracker.checkpoint_failed(step, err)
            committed.set_exception(err)
            return
        seconds = time.perf_counter() - t0
        nbytes = sum(info.nbytes for info in job.plan.arrays.values())
        self._metadata[step] = job.plan.metadata
        log.info(
            "committed step %d: %.1f MB, stall %.3fs, background %.3fs (%.2f GB/s)",
            step,
            nbytes / 1e6,
            stall,
            seconds,
            nbytes / max(seconds, 1e-9) / 1e9,
        )
        # with two tiers every commit names its tier (one tier: no tier=, as observers written for one tier expect)
        self.tracker.checkpoint_committed(step, seconds, nbytes, **({"tier": LOCAL} if self.tiers else {}))
        committed.set_result(step)
        if self.tiers is not None:
            return  # the durable tier's retention runs after each persist
        try:
            self._apply_retention()
        except Exception as e:  # a checkpoint left behind is no data loss: report, go on
            log.warning("retention after step %d failed: %s", step, e)

    def _persisted(
        self, step: int, error: BaseException | None, seconds: float = 0.0, nbytes: int | None = None
    ) -> None:
        """Persist thread: a persist ended; its error is raised by the next call, else the tracker hears of the durable
        commit (`nbytes` copied in `seconds`; None: the step was durable already) and the durable tier's retention runs."""
        if error is not None:
            with self._lock:
                self._error = self._error or CheckpointWriteError(
                    step, RuntimeError(f"persisting to {self.storage.url}: {error}")
                )
            return
        if nbytes is not None:
            self.tracker.checkpoint_committed(step, seconds, nbytes, tier=DURABLE)
        try:
            self._apply_retention()
        except Exception as e:
            log.warning("retention after persisting step %d failed: %s", step, e)

    def _apply_retention(self) -> None:
        """Queue the deletion of the committed steps the policy does not keep; never the newest, whatever it says."""
        if self.retention is None or not self.ranks.leader:
            return
        steps = layout.committed_steps(self.storage)
        if not steps:
            return
        kept = self.retention.keep(steps, StepMetadata(steps, self._saved_metadata, self._metadata))
        for s in steps:
            if s not in kept and s != steps[-1]:
                self._queue_delete(s, report=False)

    def _saved_metadata(self, step: int) -> Mapping[str, Any]:
        """A committed step's save metadata for retention; {} when its manifest is unreadable or gone."""
        try:
            return read_manifest(self.storage, step).metadata
        except (CorruptCheckpointError, StepNotFoundError):
            return {}

    def _queue_delete(self, step: int, *, report: bool) -> None:
        """Delete a committed step on the deleter thread; neither the training thread nor a later save waits for it.

        Once the interpreter is exiting without `close()` (its thread pools take no new work), the delete runs here
        instead, on the writer thread, which the exit waits for: retention still runs, manifest first, and says
        nothing went wrong.
        """
        with self._lock:
            if step in self._deleting:
                return
            placeholder = self._deleting[step] = Future()  # the delete may run right here (`submit_or_run`)
        done = submit_or_run(self._deleter, self._delete_now, step, report)
        with self._lock:
            if step in self._deleting:  # not yet done: the pool's future stands for it
                self._deleting[step] = done
        done.add_done_callback(lambda _: placeholder.set_result(None))  # for a `wait()` that took the placeholder

    def _delete_now(self, step: int, report: bool) -> None:
        """Deleter thread: remove the step (manifest first); an error is raised by the next call when `report`."""
        try:
            catalog.delete_step(self.storage, step)
            self._metadata.pop(step, None)
            log.info("deleted step %d", step)
        except Exception as e:
            if not report:  # retention: a checkpoint left behind is no data loss
                log.warning("retention could not delete step %d: %s", step, e)
            else:
                log.error("deleting step %d failed: %s", step, e)
                with self._lock:
                    self._error = self._error or CheckpointDeleteError(step, e)
        finally:
            with self._lock:
                self._deleting.pop(step, None)

    def _take_lease(self, collective: bool) -> None:
        """Hold the root's lease from the first write until close; among ranks rank 0 holds it for all.

        `collective`: every rank takes part (a save), so a refusal reaches every rank at once.
        """
        error: LeaseHeldError | None = None
        if self.ranks.leader:
            try:
                if self._lease is None:
                    self._lease = lease_mod.acquire(self.storage, ttl=self.lease_ttl)
                else:
                    self._lease.check()
            except (LeaseHeldError, StorageError) as e:  # every rank learns it, none waits in the gather below
                error = e
        if collective and not self._writer_agreed:
            verdict = self.ranks.all_gather_json(None if error is None else str(error))[0]
            if verdict and error is None:
                error = LeaseHeldError(verdict)
            self._writer_agreed = verdict is None
        if error is not None:
            raise error

    def _drain(self) -> None:
        """Wait for the save in flight; its error is raised here unless a handle already reported it."""
        handle, self._inflight = self._inflight, None
        if handle is not None:
            futures_wait([handle._future])
        self._raise_error()

    def _consume(self, err: CheckpointWriteError) -> None:
        with self._lock:
            if self._error is err:
                self._error = None

    def _raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.storage.url!r}) is closed")

    def wait(self) -> None:
        """Block until every save in flight is committed and every delete done; raises a background error, if any."""
        self._drain()
        if not self._closed:
            self._writer.submit(lambda: None).result()  # retention of the last commit has queued its deletes
        if self.tiers is not None:
            self.tiers.wait()  # the persist in flight, and the durable retention it queued
        with self._lock:
            deletes = list(self._deleting.values())
        futures_wait(deletes)
        self._raise_error()

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Allocate and pre-fault the host snapshot buffer for `state` in the background, so that the next save
        copies into warm memory (a first save into fresh pages stalls ~10x longer). Returns at once.

        `restore` does it by itself, also on a fresh start, sized from the state it was given; call this once the
        state has its full size, e.g. after the first optimizer step (an optimizer's state appears there).
        """
        self._check_open()
        self._reserve_sizes(
            [local_box(t)[0].nbytes for t in state_mod.flatten(state, rank=self.ranks.rank).tensors.values()]
        )

    def _reserve_sizes(self, sizes: list[int]) -> None:
        self._writer.submit(self._reserve_now, sizes)
        if self.snapshot == "overlap":  # start its thread now: inside the first save's stall it took ~1 ms
            self._snapshotter.submit(lambda: None)

    def _reserve_now(self, sizes: list[int]) -> None:
        """Writer thread: a failed reservation loses nothing (the next save allocates); it is reported, not raised."""
        try:
            self._arena.reserve(sizes)
        except Exception as e:
            log.warning("could not reserve %.1f MB of staging memory ahead of the next save: %s", sum(sizes) / 1e6, e)

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

        Nothing reaches `state` unless every read of the step verified: a failed restore leaves it as it
        was. Without `step`, a damaged checkpoint is reported (warning), moved aside to
        ``ROOT/_quarantine/`` (so that training can save that step again) and the previous one is tried; a
        step deleted while being read (another process's retention) is no damage: the steps are listed
        again. All ranks agree on the step. `keys` restricts the restore to some top-level entries of the
        state (e.g. ``["model"]``); without it, the state and the checkpoint must have the same keys.
        Per-rank entries (RNG) saved at another world size go to rank i from rank ``i % saved_world_size``
        (``rank_map="modulo"``, the default) or are left as they are (``"skip"``: the caller reseeds).
        `track=False` keeps the restore from the tracker: a load for evaluation (best model, weights only)
        is not where the job resumed.

        With a local tier (``local=``) the newest intact step of either tier is taken, the local tier first for
        the same step; a rank whose local copy is lost gets it back from its peer's replica first, and a damaged
        local step falls back to the durable tier. The tier read from is logged and told to the tracker.
        """
        if rank_map not in ("modulo", "skip"):
            raise ValueError(f"rank_map must be 'modulo' or 'skip', got {rank_map!r}")
        self._check_open()
        self.wait()
        restored: int | None = None
        tracker = self.tracker if track else _NO_TRACKER
        with tracker.span("checkpoint_restore"):
            prepare_optimizers(state, keys)
            t0 = time.perf_counter()
            damaged: dict[tuple[int, str], CorruptCheckpointError] = {}
            candidates, relists, tier = self._candidates(step, damaged), 0, None
            while candidates:
                source = candidates.pop(0)
                s, storage = source.step, self._storage(source)
                error = self.tiers.heal(source) if source.heal else None  # a lost local copy back from its peer
                plan, error = self._read(storage, s, state, keys, rank_map) if error is None else (None, error)
                outcome = self._agree(storage, s, error)  # one decision for every rank
                if outcome == "vanished":
                    if step is not None:
                        raise StepNotFoundError(f"step {step} is not committed in {self.storage.url}")
                    relists += 1
                    if relists > _MAX_RELISTS:
                        raise CheckpointError(
                            f"steps of {self.storage.url} vanished while being read, {relists} times: "
                            f"is another process deleting them?"
                        )
                    log.info("step %d vanished while being read (retention?); listing the steps again", s)
                    candidates = self._candidates(step, damaged)
                    continue
                if isinstance(outcome, CorruptCheckpointError):
                    damaged[(s, source.tier)] = outcome
                    if step is not None and not candidates:
                        raise outcome
                    where = f" in the {source.tier} tier" if self.tiers else ""
                    aside = self._set_aside(source, outcome, error)
                    warnings.warn(
                        f"checkpoint step {s}{where} is damaged: {outcome}; {aside}; falling back to the "
                        f"{'durable copy of the step' if candidates and candidates[0].step == s else 'previous committed step'}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                restore_mod.apply(plan, state)
                restored = s
                if self.tiers is not None and track:  # where the job resumes: may the durable tier lag behind?
                    self.tiers.resumed(source.tier == LOCAL and Source(s, DURABLE) not in candidates)
                tier = PEER if self.ranks.rank in source.heal else source.tier
                sizes = [r.nbytes for r in plan.reads.values()]
                log.info(
                    "restored step %d from %s (%s tier): %.1f MB in %.2fs",
                    s,
                    storage.url,
                    tier,
                    sum(sizes) / 1e6,
                    time.perf_counter() - t0,
                )
                if keys is None:  # the arena now holds what was read; grow it to the whole state in the background
                    self._reserve_sizes(sizes)
                break
            if restored is None and damaged:
                raise CorruptCheckpointError(
                    f"no intact checkpoint in {self.storage.url}: {len(damaged)} damaged "
                    f"(newest error: {next(iter(damaged.values()))})"
                )
            if restored is None and keys is None:  # a fresh start: the first save should not fault in its arena
                try:
                    self.reserve(state)
                except (TypeError, ValueError) as e:  # a state `save` would refuse: the save says so, naming the key
                    log.debug("no staging reserved ahead of the first save: %s", e)
        if damaged and restored is not None:
            log.warning("restored step %d after skipping %d damaged step(s)", restored, len(damaged))
        tracker.checkpoint_restored(restored, tier=tier if self.tiers else None)  # one tier: None, as ettr reads it
        return restored

    def _candidates(self, step: int | None, damaged: Mapping[tuple[int, str], Any]) -> list[Source]:
        """Where to try, newest first: `step`, or every committed step not found damaged, in its tiers (one list for
        all ranks: rank 0's view of the durable root, and with a local tier every rank's inventory)."""
        durable = self.ranks.all_gather_json(layout.committed_steps(self.storage))[0]
        if self.tiers is None:
            sources = [Source(s, DURABLE) for s in sorted(durable, reverse=True)]
        else:
            sources = self.tiers.sources(durable)
        sources = [c for c in sources if (c.step, c.tier) not in damaged and step in (None, c.step)]
        return sources if sources or step is None else [Source(step, DURABLE)]

    def _storage(self, source: Source) -> Storage:
        """The root a rank reads a source from: its own local tier, or the durable root."""
        return self.tiers.local if source.tier == LOCAL else self.storage

    def _read(
        self, storage: Storage, s: int, state: dict[str, Any], keys: Sequence[str] | None, rank_map: str
    ) -> tuple[restore_mod.ReadPlan | None, CorruptCheckpointError | StepNotFoundError | None]:
        """This rank's read of step `s`, the mirror of a save: manifest, plan, verified reads; or why it failed.

        A mismatch between `state` and the checkpoint (StateKeyError, StateMismatchError) is raised here, before
        anything is read. Nothing is applied to `state`.
        """
        try:
            manifest = layout.read_manifest(storage, s)
            plan = restore_mod.plan_restore(
                manifest, state, keys, self.ranks, rank_map=rank_map, files=restore_mod.step_files(storage, s)
            )
            restore_mod.execute(storage, plan, self._readers, self._arena)
            return plan, None
        except (CorruptCheckpointError, StepNotFoundError) as e:
            return None, e

    def _agree(
        self, storage: Storage, s: int, error: CorruptCheckpointError | StepNotFoundError | None
    ) -> CorruptCheckpointError | str | None:
        """Every rank's outcome of reading step `s`, one decision for all: None (read everywhere), "vanished" (it
        was deleted meanwhile, e.g. by another process's retention: no damage) or its damage."""
        verdict = (
            "ok"
            if error is None
            else (
                "vanished" if isinstance(error, StepNotFoundError) or not layout.is_committed(storage, s) else "damaged"
            )
        )
        reports = self.ranks.all_gather_json([verdict, None if error is None else str(error)])
        verdicts = [v for v, _ in reports]
        if "vanished" in verdicts:
            return "vanished"
        if "damaged" not in verdicts:
            return None
        if isinstance(error, CorruptCheckpointError):
            return error
        return CorruptCheckpointError(
            f"another rank found damage: {next(m for v, m in reports if v == 'damaged')}", step=s
        )

    def _set_aside(self, source: Source, error: CorruptCheckpointError, own: BaseException | None) -> str:
        """Quarantine a damaged step and say where it went, or why it could not be moved: in the durable root
        rank 0 does it for all; in the local tier each rank whose own copy is damaged moves it aside."""
        s = source.step
        if source.tier == LOCAL:
            if not isinstance(own, CorruptCheckpointError) or not layout.is_committed(self.tiers.local, s):
                return "another rank's local copy is damaged"
            try:
                self.tiers.take_lease()
                return f"quarantined to {catalog.quarantine(self.tiers.local, s, str(error))}"
            except (LeaseHeldError, OSError) as e:
                return f"could not be quarantined ({e})"
        if not self.ranks.leader:
            return "quarantined by rank 0"
        borrowed = None
        try:
            if self._lease is None:  # moving a step is a write: never beside another live writer
                borrowed = lease_mod.acquire(self.storage, role="quarantine", wait_for_gc=0)
            return f"quarantined to {catalog.quarantine(self.storage, s, str(error))}"
        except LeaseHeldError as e:
            return f"left in place ({e})"
        except OSError as e:
            log.warning("could not quarantine damaged step %d: %s", s, e)
            return f"could not be quarantined ({e})"
        finally:
            if borrowed is not None:
                borrowed.release()

    # -- queries and lifetime -----------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """Committed steps, ascending (a step queued for deletion is no longer listed); each is an int whose
        `tiers` says where it is: ``("durable",)`` without a local tier, else ``"local"``, ``"durable"`` or both."""
        with self._lock:
            deleting = set(self._deleting)
        durable = [s for s in layout.committed_steps(self.storage) if s not in deleting]
        return self.tiers.steps(durable) if self.tiers else [Step(s, (DURABLE,)) for s in durable]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def delete(self, step: int) -> None:
        """Delete a committed step in the background (manifest first); never the newest committed one, nor one
        still being written. Returns at once; `steps()` stops listing it; an error is raised by the next call."""
        self._check_open()
        self._raise_error()
        if self._inflight is not None and self._inflight.step == step and not self._inflight.done():
            raise ValueError(f"step {step} is still being written")
        committed = self.steps()
        if step not in committed:
            raise StepNotFoundError(
                f"step {step} is not a committed step of {self.storage.url} (committed: {committed})"
            )
        if step == committed[-1]:
            raise ValueError(f"step {step} is the newest committed step; it is never deleted")
        tiers = committed[committed.index(step)].tiers
        if LOCAL in tiers:
            self.tiers.take_lease()
            catalog.delete_step(self.tiers.local, step)
        if DURABLE in tiers:
            self._take_lease(collective=False)
            self._queue_delete(step, report=True)

    def metadata(self, step: int) -> dict[str, Any]:
        """The user metadata saved with a committed step (from the local tier when it holds the step)."""
        local = self.tiers is not None and layout.is_committed(self.tiers.local, step)
        return read_manifest(self.tiers.local if local else self.storage, step).metadata

    def close(self) -> None:
        """Drain writes (raising a background error, if any), release threads and the root's lease."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self._deleter.shutdown(wait=True)
            self._snapshotter.shutdown(wait=True)
            if self._fence is not None:
                self._fence.close()
            self._fsyncs.shutdown(wait=True)
            self._readers.shutdown(wait=True)
            if self.tiers is not None:
                self.tiers.close()
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the loop's exception with a write error; still drain
            with contextlib.suppress(Exception):
                self.close()
