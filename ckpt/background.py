"""The manager's background machinery: its threads, the save in flight, the error slot, the delete queue, the
overlapped snapshot's fence and the staging arena's reservation.

The manager decides what runs (policy); this runs it off the training thread and hands every failure back to
the next call (`raise_error`) or to the `SaveHandle` of the save that failed, never both.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, ContextManager

from . import snapshot as snapshot_mod
from .budget import WriteBudget
from .errors import CheckpointDeleteError, CheckpointError, CheckpointWriteError
from .pools import submit_or_run
from .staging import StagingArena

log = logging.getLogger("ckpt")

Span = Callable[..., ContextManager[Any]]


class SaveHandle:
    """A save in flight: `done()` polls, `wait()` blocks until committed and raises its error, if any;
    `wait_snapshot()` blocks until its host snapshot is complete (the state may then change in any way)."""

    def __init__(
        self, step: int, future: Future, background: "Background", pending: snapshot_mod.Pending | None = None
    ):
        self.step, self._future, self._background, self._pending = step, future, background, pending

    def done(self) -> bool:
        """Whether the save has ended: committed, or failed (`wait` raises its error)."""
        return self._future.done()

    def wait_snapshot(self) -> None:
        """Wait until every tensor of this save is copied to host memory (timed as checkpoint_save).

        With ``snapshot="sync"`` (the default) `save` has copied everything already: this returns at once. With
        ``snapshot="overlap"`` an optimizer's `step()` does this by itself; call it before changing the
        parameters or optimizer state in place any other way (an EMA swap, ``p.data`` writes, a numpy view). It
        never raises: a failed save is raised by `wait()` or the manager's next call.
        """
        if self._pending is not None:  # else everything was copied inside save
            self._background.await_snapshot(self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed (durable), or raise its `CheckpointWriteError`; `timeout` in seconds."""
        try:
            self._future.result(timeout)
        except CheckpointWriteError as e:
            self._background.consume(e)
            raise


class Background:
    """Runs a manager's writes, deletes and overlapped copies off the training thread, one save at a time.

    `span` times the waits training makes for it (the manager's tracker); `budget` is what its threads may use.
    """

    def __init__(self, budget: WriteBudget, *, io_threads: int, max_staging_bytes: int | None, span: Span):
        self.span = span
        self.arena = StagingArena(max_staging_bytes)
        lower = budget.lower_this_thread  # background threads yield the CPU to training
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer", initializer=lower)
        self.readers = ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-reader")
        self._deleter = ThreadPoolExecutor(1, "ckpt-deleter", initializer=lower)  # no save ever waits for it
        # the overlapped part of a snapshot: at training's priority, as an optimizer step may be waiting for it
        self._snapshotter = ThreadPoolExecutor(1, "ckpt-snapshot")
        # fsyncs of the chunk files a save writes itself (a local root): they wait for the disk, side by side
        self.fsyncs = ThreadPoolExecutor(budget.threads()[1], "ckpt-fsync", initializer=lower)
        self._pending: snapshot_mod.Pending | None = None  # the copies of the save in flight not yet made
        self._fence: snapshot_mod.Fence | None = None  # makes optimizer steps wait for them
        self._deleting: dict[int, Future] = {}
        self.inflight: SaveHandle | None = None
        self._error: CheckpointError | None = None
        self._lock = threading.Lock()

    # -- the error slot -----------------------------------------------------------------------------

    def fail(self, error: CheckpointError, *, unless_failed: bool = False) -> None:
        """Keep `error` for the next call (`unless_failed`: only when no earlier error waits there)."""
        with self._lock:
            if not (unless_failed and self._error is not None):
                self._error = error

    def consume(self, error: CheckpointError) -> None:
        """A handle raised `error` itself: the next call does not raise it again."""
        with self._lock:
            if self._error is error:
                self._error = None

    def raise_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    # -- saves --------------------------------------------------------------------------------------

    def start_snapshot(self, pending: snapshot_mod.Pending) -> None:
        """Copy a save's overlapped tensors on the snapshot thread; every optimizer step waits for them first."""
        if self._fence is None:
            self._fence = snapshot_mod.Fence(self.await_snapshot)
        self._snapshotter.submit(pending.run)
        self._pending = pending

    def await_snapshot(self, pending: snapshot_mod.Pending | None = None) -> None:
        """Wait for a save's overlapped copies (default: the save in flight's), timed as the checkpoint_save part
        "overlap_wait"; the fence of every optimizer step. Never raises: the save's error reaches the loop through the manager's calls."""
        pending = pending or self._pending
        if pending is None or pending.done():
            return
        t0 = time.perf_counter()
        with self.span("checkpoint_save", step=pending.step, part="overlap_wait"):
            pending.wait()
        log.debug(
            "waited %.3fs for the snapshot of step %d before changing its tensors",
            time.perf_counter() - t0,
            pending.step,
        )

    def submit_save(
        self,
        step: int,
        commit: Callable[[], Any],
        *,
        failed: Callable[[CheckpointWriteError], None],
        then: Callable[[Any], None],
        pending: snapshot_mod.Pending | None = None,
    ) -> SaveHandle:
        """Run `commit` on the writer thread; its failure becomes a `CheckpointWriteError`, kept for the next call
        and handed to `failed`; after a success the handle resolves, then `then(commit's result)` runs (retention,
        which reports its own failures: a step left behind is no data loss)."""
        committed: Future = Future()

        def run() -> None:
            try:
                result = commit()
            except BaseException as e:
                err = CheckpointWriteError(step, e)
                self.fail(err)
                log.error("checkpoint step %d failed: %s", step, e)
                try:
                    failed(err)
                except Exception as reporting:  # an observer's own error: the handle still resolves (else every
                    log.warning("after checkpoint step %d failed: %s", step, reporting)  # later wait hangs)
                committed.set_exception(err)
                return
            committed.set_result(step)
            then(result)

        self._writer.submit(run)
        self.inflight = SaveHandle(step, committed, self, pending)
        return self.inflight

    def writing(self, step: int) -> bool:
        """Whether `step` is the save still being written."""
        return self.inflight is not None and self.inflight.step == step and not self.inflight.done()

    def drain(self) -> None:
        """Wait for the save in flight; its error is raised here unless a handle already reported it. Interrupted
        (Ctrl-C), the save stays in flight: the next save waits for it before it copies into the arena it writes
        from."""
        handle = self.inflight
        if handle is not None:
            futures_wait([handle._future])
            if self.inflight is handle:
                self.inflight = None
        self.raise_error()

    def barrier(self) -> None:
        """Wait until the writer thread has run everything submitted so far (a commit's retention included)."""
        self._writer.submit(lambda: None).result()

    def reserve(self, sizes: list[int], *, warm_snapshot: bool) -> None:
        """Allocate and pre-fault the arena for tensors of `sizes` on the writer thread; a failure loses nothing
        (the next save allocates) and is reported, not raised. `warm_snapshot`: start the snapshot thread too
        (inside the first save's stall it took ~1 ms)."""
        self._writer.submit(self._reserve_now, sizes)
        if warm_snapshot:
            self._snapshotter.submit(lambda: None)

    def _reserve_now(self, sizes: list[int]) -> None:
        try:
            self.arena.reserve(sizes)
        except Exception as e:
            log.warning("could not reserve %.1f MB of staging memory ahead of the next save: %s", sum(sizes) / 1e6, e)

    # -- deletes ------------------------------------------------------------------------------------

    def deleting(self) -> set[int]:
        """Steps queued for deletion and not yet gone."""
        with self._lock:
            return set(self._deleting)

    def wait_delete(self, step: int) -> None:
        """Wait for a delete of `step` in flight, if any (a step is never written while it is being deleted)."""
        with self._lock:
            pending = self._deleting.get(step)
        if pending is not None:
            futures_wait([pending])

    def queue_delete(self, step: int, delete: Callable[[], None], *, report: bool) -> None:
        """Run `delete` of `step` on the deleter thread; neither training nor a later save waits for it. Its failure
        is logged, and with `report` raised by the next call (retention: a step left behind is no data loss).

        Once the interpreter is exiting without `close()` (its thread pools take no new work), the delete runs here
        instead, on the writer thread, which the exit waits for: retention still runs and says nothing went wrong.
        """
        with self._lock:
            if step in self._deleting:
                return
            placeholder = self._deleting[step] = Future()  # the delete may run right here (`submit_or_run`)
        done = submit_or_run(self._deleter, self._delete_now, step, delete, report)
        with self._lock:
            if step in self._deleting:  # not yet done: the pool's future stands for it
                self._deleting[step] = done
        done.add_done_callback(lambda _: placeholder.set_result(None))  # for a `wait()` that took the placeholder

    def _delete_now(self, step: int, delete: Callable[[], None], report: bool) -> None:
        try:
            delete()
            log.info("deleted step %d", step)
        except Exception as e:
            if not report:
                log.warning("retention could not delete step %d: %s", step, e)
            else:
                log.error("deleting step %d failed: %s", step, e)
                self.fail(CheckpointDeleteError(step, e), unless_failed=True)
        finally:
            with self._lock:
                self._deleting.pop(step, None)

    def wait_deletes(self) -> None:
        """Wait for every delete queued so far."""
        with self._lock:
            deletes = list(self._deleting.values())
        futures_wait(deletes)

    def close(self) -> None:
        """Stop every thread once its work is done (the fence is removed: optimizer steps no longer wait)."""
        self._writer.shutdown(wait=True)
        self._deleter.shutdown(wait=True)
        self._snapshotter.shutdown(wait=True)
        if self._fence is not None:
            self._fence.close()
        self.fsyncs.shutdown(wait=True)
        self.readers.shutdown(wait=True)
        self.arena.close()
