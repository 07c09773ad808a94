"""CheckpointManager: the policy — when a save runs, which step a restore takes, what is kept."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, ContextManager, Mapping, Protocol, Sequence

import torch.distributed as dist

from . import catalog
from . import lease as lease_mod
from .checkpointer import SaveJob, plan, read_manifest, restore_into
from .distributed import Ranks, prepare_optimizers
from .errors import CheckpointWriteError, CorruptCheckpointError, LeaseHeldError
from .format import MANIFEST, step_dir
from .retention import Retention
from .staging import StagingArena
from .storage import Storage, context, open_storage

log = logging.getLogger("ckpt")


class CheckpointObserver(Protocol):
    """What the manager tells a goodput tracker (e.g. `ettr.GoodputTracker`); every method must be thread-safe."""

    def span(self, category: str, **attrs: Any) -> ContextManager[Any]: ...
    def checkpoint_committed(self, step: int, background_seconds: float) -> None: ...
    def checkpoint_restored(self, step: int | None) -> None: ...
    def checkpoint_failed(self, step: int, error: BaseException) -> None: ...


class _NoTracker:
    def span(self, category: str, **attrs: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def checkpoint_committed(self, step: int, background_seconds: float) -> None:
        pass

    def checkpoint_restored(self, step: int | None) -> None:
        pass

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        pass


class SaveHandle:
    """A save in flight: `done()` polls, `wait()` blocks until committed and raises its error, if any."""

    def __init__(self, step: int, future: Future, manager: "CheckpointManager"):
        self.step, self._future, self._manager = step, future, manager

    def done(self) -> bool:
        return self._future.done()

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
        keep_last, keep_every, keep_best, best_metric, best_mode: retention (see `Retention`).
        max_staging_bytes: cap on the host snapshot buffer; larger states are snapshotted in waves.
        chunk_bytes: target size of one chunk file (one chunk per tensor up to this size).
        tracker: a `CheckpointObserver` (such as `ettr.GoodputTracker`) told about saves and restores.
        io_threads: concurrent chunk reads on restore.
        collective_timeout: seconds a rank waits for the others during a save or restore before failing.

    With torch.distributed initialized, every rank creates the manager (it makes a gloo group for its
    own collectives) and calls `save`/`restore` with the same step: each rank writes only its slices.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None, best_mode: str = "min",
                 max_staging_bytes: int | None = None, chunk_bytes: int = 64 << 20,
                 tracker: CheckpointObserver | None = None, io_threads: int = 8, collective_timeout: float = 600.0):
        self.storage: Storage = open_storage(root)
        self.retention = Retention(keep_last, keep_every, keep_best, best_metric, best_mode)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.tracker: CheckpointObserver = tracker if tracker is not None else _NoTracker()
        self._arena = StagingArena(max_staging_bytes)
        distributed = dist.is_available() and dist.is_initialized()
        self.ranks: Ranks | None = Ranks(timedelta(seconds=collective_timeout)) if distributed else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-reader")
        self._inflight: SaveHandle | None = None
        self._error: CheckpointWriteError | None = None
        self._lock = threading.Lock()
        self._metadata: dict[int, dict[str, Any]] = {}
        self._lease: lease_mod.Lease | None = None  # the root's lease (rank 0's), taken at the first save
        self._writer_agreed = False  # every rank knows the lease is held
        self._closed = False

    # -- saving -------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None) -> SaveHandle:
        """Snapshot `state` into host memory and write it in the background; returns once the snapshot is taken.

        A save still writing is waited for first (never two interleaved). An error of an earlier
        background write is raised here, before anything new is written. The first save takes the root's
        lease (one writer per root): `LeaseHeldError` names the live writer holding it.
        """
        self._check_open()
        self._raise_error()
        with self.tracker.span("checkpoint_save", step=step):
            self._drain()
            self._take_lease(collective=True)
            if self.storage.read(f"{step_dir(step)}/{MANIFEST}") is not None:
                raise ValueError(f"step {step} is already committed in {self.storage.url}; "
                                 f"a committed checkpoint is never overwritten")
            t0 = time.perf_counter()
            job = SaveJob(self.storage, plan(step, state, metadata, self.chunk_bytes, self.ranks), self._arena,
                          context(), self.ranks, self._lease)
            stall = time.perf_counter() - t0
        committed: Future = Future()
        self._writer.submit(self._background, job, stall, committed)
        self._inflight = SaveHandle(step, committed, self)
        return self._inflight

    def _background(self, job: SaveJob, stall: float, committed: Future) -> None:
        """Write and commit (resolving `committed`), then apply retention before the next save may start."""
        step, t0 = job.plan.step, time.perf_counter()
        try:
            job.run()
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
        log.info("committed step %d: %.1f MB, stall %.3fs, background %.3fs (%.2f GB/s)", step, nbytes / 1e6,
                 stall, seconds, nbytes / max(seconds, 1e-9) / 1e9)
        self.tracker.checkpoint_committed(step, seconds)
        committed.set_result(step)
        try:
            self._apply_retention()
        except Exception as e:  # a checkpoint left behind is no data loss: report, go on
            log.warning("retention after step %d failed: %s", step, e)

    def _apply_retention(self) -> None:
        if not self.retention.active or (self.ranks is not None and self.ranks.rank != 0):
            return
        steps = catalog.committed_steps(self.storage)
        if self.retention.keep_best:
            for s in steps:
                if s not in self._metadata:
                    try:
                        self._metadata[s] = read_manifest(self.storage, s).metadata
                    except (CorruptCheckpointError, FileNotFoundError):
                        self._metadata[s] = {}
        for s in self.retention.to_delete(steps, self._metadata):
            catalog.delete_step(self.storage, s)
            self._metadata.pop(s, None)
            log.info("retention removed step %d", s)

    def _take_lease(self, collective: bool) -> None:
        """Hold the root's lease from the first write until close; among ranks rank 0 holds it for all.

        `collective`: every rank takes part (a save), so a refusal reaches every rank at once.
        """
        leader = self.ranks is None or self.ranks.rank == 0
        error: LeaseHeldError | None = None
        if leader:
            try:
                if self._lease is None:
                    self._lease = lease_mod.acquire(self.storage)
                else:
                    self._lease.check()
            except LeaseHeldError as e:
                error = e
        if collective and self.ranks is not None and not self._writer_agreed:
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
            self._writer.submit(lambda: None).result()  # retention of that step is done too
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
        """Block until every save in flight is committed; raises a background write error, if any."""
        self._drain()

    # -- restoring ----------------------------------------------------------------------------------

    def restore(self, state: dict[str, Any], *, step: int | None = None, keys: Sequence[str] | None = None,
                rank_map: str = "modulo", track: bool = True) -> int | None:
        """Load the newest intact committed step (or `step`) into `state` in place; returns the step or None.

        Without `step`, a damaged checkpoint is reported (warning) and the previous one is tried (all
        ranks agree on the step). `keys` restricts the restore to some top-level entries of the state
        (e.g. ``["model"]``). Per-rank entries (RNG) saved at another world size go to rank i from rank
        ``i % saved_world_size`` (``rank_map="modulo"``, the default) or are left as they are
        (``"skip"``: the caller reseeds). `track=False` keeps the restore from the tracker: a load for
        evaluation (best model, weights only) is not where the job resumed.
        """
        if rank_map not in ("modulo", "skip"):
            raise ValueError(f"rank_map must be 'modulo' or 'skip', got {rank_map!r}")
        self._check_open()
        self.wait()
        restored: int | None = None
        tracker = self.tracker if track else _NoTracker()
        with tracker.span("checkpoint_restore"):
            candidates = [step] if step is not None else sorted(catalog.committed_steps(self.storage), reverse=True)
            failures: list[CorruptCheckpointError] = []
            prepare_optimizers(state, keys)
            t0 = time.perf_counter()
            rank, world = (self.ranks.rank, self.ranks.world_size) if self.ranks else (0, 1)
            for s in candidates:
                error: CorruptCheckpointError | None = None
                try:
                    sizes = restore_into(self.storage, read_manifest(self.storage, s), state, keys, context(),
                                          self._readers, rank=rank, world_size=world, rank_map=rank_map)
                except CorruptCheckpointError as e:
                    error = e
                if self.ranks is not None:  # every rank takes the same step
                    bad = [m for m in self.ranks.all_gather_json(None if error is None else str(error)) if m]
                    if bad and error is None:
                        error = CorruptCheckpointError(f"another rank found damage: {bad[0]}", step=s)
                if error is not None:
                    if step is not None:
                        raise error
                    failures.append(error)
                    warnings.warn(f"checkpoint step {s} is damaged: {error}; falling back to the previous committed step",
                                  RuntimeWarning, stacklevel=2)
                    continue
                restored = s
                log.info("restored step %d from %s: %.1f MB in %.2fs", s, self.storage.url, sum(sizes) / 1e6,
                         time.perf_counter() - t0)
                if keys is None:  # warm the snapshot buffer now, so the first save copies into touched memory
                    self._writer.submit(self._arena.reserve, sizes)
                break
            if restored is None and failures:
                raise CorruptCheckpointError(f"no intact checkpoint in {self.storage.url}: {len(failures)} damaged "
                                             f"(newest error: {failures[0]})")
        if failures and restored is not None:
            log.warning("restored step %d after skipping %d damaged step(s)", restored, len(failures))
        tracker.checkpoint_restored(restored)
        return restored

    # -- queries and lifetime -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return catalog.committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def delete(self, step: int) -> None:
        """Delete a committed step (manifest first); never the newest committed one, nor one still being written."""
        self._check_open()
        if self._inflight is not None and self._inflight.step == step and not self._inflight.done():
            raise ValueError(f"step {step} is still being written")
        committed = self.steps()
        if step not in committed:
            raise ValueError(f"step {step} is not a committed step of {self.storage.url} (committed: {committed})")
        if step == committed[-1]:
            raise ValueError(f"step {step} is the newest committed step; it is never deleted")
        self._take_lease(collective=False)
        catalog.delete_step(self.storage, step)
        self._metadata.pop(step, None)

    def metadata(self, step: int) -> dict[str, Any]:
        """The user metadata saved with a committed step."""
        return read_manifest(self.storage, step).metadata

    def close(self) -> None:
        """Drain writes (raising a background error, if any), release threads and the root's lease."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self._readers.shutdown(wait=True)
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
