"""How much of the machine a background write may take: its concurrency and its threads' CPU priority.

Measured on 2 cores (docs/benchmarks.md, `bench/interference.py`): what starves a training thread while a
save writes is CPU contention, not the GIL: runnable write threads beside it, each copying into the page
cache. So the write is kept to one busy thread where it can be, with the rest waiting on the disk:

- a local root's chunk files are written by the save's own thread, from the arena, O_DIRECT where the
  filesystem allows (`chunk_files.py`); `file_ops_per_core` x `cores` threads overlap their fsyncs, which
  wait for the disk and take next to no CPU. A training thread beside it keeps 0.88-0.99x of its speed
  while the write runs (about what the disk IO itself costs on that VM), and the write is ~3x shorter than
  through tensorstore's pool (docs/benchmarks.md);
- what tensorstore writes (object stores, the memory root, arrays not chunked by whole rows) runs in a
  child context of the root's with `data_copy_concurrency` = `cores` x the CPUs and `file_io_concurrency`
  `file_ops_per_core` times that (the child keeps the root's other resources, e.g. the ``memory://`` store);
- priority: the threads of a write run at a raised nice value, so that under contention the training
  thread's CPU share comes first, yet the write still progresses (nice, not SCHED_IDLE, which starved the
  write for 20 s on a loaded machine). Where other processes at nice 0 want the CPU too (busy data-loader
  workers), nice 10 slows the write (2-7x measured on a loaded machine): use ``WriteBudget(nice=5)`` or 0
  there. That covers the library's threads (writer, fsyncs, deleter) and tensorstore's pool workers, found by
  name (``ts_pool_worker``).

Tensorstore's workers are shared by every tensorstore user of the process and a raised nice value cannot be
lowered again without CAP_SYS_NICE: once a save ran, other tensorstore work in this process (a data loader
reading through tensorstore, say) also runs at that priority. Set ``nice=0`` to leave every thread alone.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
from dataclasses import dataclass
from typing import Any

import tensorstore as ts

log = logging.getLogger("ckpt")
_POOL_THREAD = "ts_pool_worker"  # the name tensorstore gives its pool's worker threads (Linux comm)


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask; cgroup quotas are not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class WriteBudget:
    """What a background save may use of the machine; `CheckpointManager(write_budget=...)`.

    Args:
        cores: share of this process's CPUs that tensorstore's writes may keep busy (at least one thread):
            its ``data_copy_concurrency``; ``file_io_concurrency`` is `file_ops_per_core` times as many. A local
            root's chunk files are written by one thread whatever the share (see the module doc).
        file_ops_per_core: concurrent file operations per budgeted core: the fsyncs of a local root's chunk
            files (they wait for the disk), tensorstore's file operations elsewhere; more overlap more fsyncs
            (durable sooner), but a tensorstore file operation is also a thread copying into the page cache
            (CPU), and the scheduler shares a core per runnable thread.
        nice: niceness (0-19) of the write's threads: at 10 a training thread gets ~9x the CPU share of each
            (scheduler weights 1024 vs 110), at 5 ~3x, at 19 ~68x; 0 leaves every thread's priority alone.
            Raising it is one-way without CAP_SYS_NICE.
    """

    cores: float = 0.5
    file_ops_per_core: int = 2
    nice: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.cores <= 1:
            raise ValueError(f"WriteBudget.cores is a share of the CPUs, in (0, 1]; got {self.cores}")
        for name in ("file_ops_per_core", "nice"):  # a thread count and a niceness: a float failed the writer thread's
            value = getattr(self, name)  # start (os.setpriority), and every save then waited for it forever
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"WriteBudget.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.file_ops_per_core < 1:
            raise ValueError(f"WriteBudget.file_ops_per_core must be at least 1, got {self.file_ops_per_core}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"WriteBudget.nice must be in [0, 19], got {self.nice}")

    @classmethod
    def of(cls, budget: "WriteBudget | float | None") -> "WriteBudget":
        """A budget from the manager's argument: None is the default, a number the share of cores."""
        if budget is None:
            return cls()
        if isinstance(budget, WriteBudget):
            return budget
        if isinstance(budget, (int, float)) and not isinstance(budget, bool):
            return cls(cores=float(budget))
        raise TypeError(f"write_budget must be a WriteBudget or a share of the CPUs in (0, 1], got {budget!r}")

    def threads(self) -> tuple[int, int]:
        """(data copy threads, concurrent file operations) on this machine."""
        copies = max(1, math.floor(self.cores * cpu_count()))
        return copies, copies * self.file_ops_per_core

    def context(self, parent: ts.Context) -> ts.Context:
        """The tensorstore context of the writes: the root's, with this budget's concurrency."""
        copies, files = self.threads()
        spec: dict[str, Any] = {"data_copy_concurrency": {"limit": copies}, "file_io_concurrency": {"limit": files}}
        return ts.Context(ts.Context.Spec(spec), parent)

    def lower_this_thread(self) -> None:
        """Run the calling thread (one of the library's background threads) at the budget's niceness."""
        _renice(threading.get_native_id(), self.nice)

    def lower_pool_threads(self) -> None:
        """Lower tensorstore's pool workers to the budget's niceness (those alive now; see the module doc)."""
        if self.nice == 0:
            return
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:  # no procfs: tensorstore's threads cannot be found
            return
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != _POOL_THREAD:
                        continue
            except OSError:  # the thread ended meanwhile
                continue
            _renice(int(tid), self.nice)


def _renice(tid: int, nice: int) -> None:
    """Raise one thread's nice value to `nice` (never lowers it: that would need privileges)."""
    if nice == 0 or not hasattr(os, "setpriority"):
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except ProcessLookupError:  # the thread ended meanwhile
        pass
    except OSError as e:
        log.debug("could not lower the priority of thread %d: %s", tid, e)
