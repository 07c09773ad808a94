"""Host snapshot of tensors into one reusable, pre-touched buffer (pinned when CUDA is present).

Copying into memory touched before runs ~10x faster than into fresh pages, so the arena is allocated
once (pre-faulted), kept across saves, and only grown when the state grows; after a restore the manager
reserves it in the background so that even the first save copies into warm memory. An optional
cap bounds it: a snapshot larger than the cap is taken in waves (the save then blocks longer instead of
allocating past the cap). A restore reads into the arena before it applies anything (`scratch`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable, Container, Iterator

import numpy as np
import torch

from .distributed import ranks_per_node
from .errors import described
from .pools import Inline, submit_or_run

_ALIGN = 4096
_PIECE = 16 << 20  # bytes of one task of a parallel copy


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _allocate(nbytes: int, populate: bool = True, stop: Callable[[], bool] = lambda: False) -> torch.Tensor:
    """A uint8 host tensor of `nbytes`, pinned when CUDA is available; with `populate` its pages are faulted
    in now (else by their first writer, e.g. the parallel reads of a restore), unless `stop()` turns true.

    In 4 KiB pages: 2 MiB ones (``MADV_HUGEPAGE``) fault in faster on a machine with free huge pages, but where
    memory is fragmented each fault may compact it first: 512 MiB took 3.5 s to fault in, against 0.35 s in
    4 KiB pages, and a fresh process's 2 GiB restore 6.2 s against 2.1 s, after 8 hours of uptime here
    (docs/benchmarks.md, run 13). A long job's host is that machine."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        _touch(np.frombuffer(buf, dtype=np.uint8), stop)
    return torch.frombuffer(buf, dtype=torch.uint8)


_TOUCH_STRIDE = 4096  # Linux's smallest page: every page is written at least once
_TOUCH_PIECE = 4 << 20  # 1,024 writes: numpy keeps the GIL for 500 or fewer (1 MiB pieces starved training)


def _touch(fresh: np.ndarray, stop: Callable[[], bool]) -> None:
    """Fault in the pages of fresh memory, which nothing else writes yet, by writing a zero byte to each, 4 MiB
    at a time until `stop()`.

    numpy writes without the GIL, and each page fault holds the memory map (at most its lock) for that one fault.
    ``MADV_POPULATE_WRITE`` (or ``MAP_POPULATE``) holds the process's memory-map lock for the range it is given
    instead: every mmap, munmap and thread start of another thread then waits for it (over 2 GiB in one call,
    2-7 s in this VM; even in 16 MiB pieces a training step that allocates its activations fell to 8 steps/s).
    """
    for start in range(0, fresh.size, _TOUCH_PIECE):
        if stop():
            return
        fresh[start : start + _TOUCH_PIECE : _TOUCH_STRIDE] = 0


@dataclass
class Staged:
    """One tensor (or a row range of it) copied into the arena."""

    name: str
    rows: tuple[int, int] | None  # row range of the source's first dim, None = whole tensor
    host: np.ndarray  # uint8 view into the arena


Copy = tuple[torch.Tensor, torch.Tensor]  # (uint8 view of the arena, source tensor)


SCRATCH = "a restore's scratch"  # what `_allocate_for` allocates for a restore (its error says what helps there)


def _mib(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def _allocate_for(
    what: str,
    nbytes: int,
    max_bytes: int | None,
    populate: bool = True,
    stop: Callable[[], bool] = lambda: False,
) -> torch.Tensor:
    """`_allocate`, whose failure (the host or the address space is out of memory: ``ENOMEM`` from mmap, a
    ``MemoryError``, a pinned allocation's ``RuntimeError``) is a MemoryError naming the bytes asked for, what they
    were for (`what`: a save's arena, a restore's scratch) and the cap, instead of a bare ``[Errno 12]``."""
    try:
        return _allocate(nbytes, populate, stop)
    except (OSError, MemoryError, RuntimeError) as e:
        cap = "no cap" if max_bytes is None else _mib(max_bytes)
        if what == SCRATCH:
            hint = (
                "a restore reads every byte into memory of its own before it applies any (all or nothing), so it needs "
                f"that much free host memory whatever max_staging_bytes is (now {cap}); keys= restores fewer entries"
            )
        else:
            hint = f"max_staging_bytes caps the arena (now {cap}): past it a save copies and writes its state in waves"
        raise MemoryError(f"could not allocate {_mib(nbytes)} of host memory for {what}: {described(e)}; {hint}") from e


def check_max_bytes(max_bytes: int | None) -> None:
    """A cap on the arena holds at least one aligned block (checked where a manager's options are made)."""
    if max_bytes is not None and max_bytes < _ALIGN:
        raise ValueError(f"max_staging_bytes must be at least {_ALIGN}, got {max_bytes}")


class StagingArena:
    """One host buffer reused by every snapshot; `plan` splits tensors into waves that fit."""

    def __init__(self, max_bytes: int | None = None, copy_threads: int | None = None):
        check_max_bytes(max_bytes)
        self.max_bytes = max_bytes
        self.copy_threads = copy_threads or default_copy_threads()  # of `stage`'s copies (the caller waits)
        self._copier = ThreadPoolExecutor(self.copy_threads, "ckpt-copy") if self.copy_threads > 1 else Inline()
        self._buf = _allocate(0)
        self._np = self._buf.numpy()
        self._lock = threading.Lock()  # serialises a background `reserve` with `stage` and `scratch`
        self._count = threading.Lock()
        self._wanted = 0  # saves waiting for `_lock`: a reservation in progress hands the arena over to them
        self._closing = False  # no save is coming: a reservation stops where it is

    def closing(self) -> None:
        """No save will come (the manager closes): a reservation in progress, or one queued, faults nothing more, so
        that `close` (and a crash right after a fresh start) does not wait for a whole state's pages."""
        self._closing = True

    def close(self) -> None:
        """Stop the copy threads and give the buffer back (a closed manager's arena copies nothing more, and its
        host memory is freed at `close`, not whenever the garbage collector next finds the manager's cycles)."""
        if isinstance(self._copier, ThreadPoolExecutor):
            self._copier.shutdown(wait=True)
        with self._lock:
            self._buf = _allocate(0)
            self._np = self._buf.numpy()

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    def _grow(self, what: str, nbytes: int, populate: bool, stop: Callable[[], bool] = lambda: False) -> None:
        """Replace the arena by one of `nbytes` (caller holds `_lock`); a failure is a MemoryError saying what for.

        The old one is let go first: a user near the host's memory limit needs the new size, not the old one plus the
        new (a reservation faulted the new pages in while the old buffer stayed resident), nor that much address space
        (``ulimit -v``). A failure then leaves an empty arena, which the next save grows again."""
        self._buf = _allocate(0)
        self._np = self._buf.numpy()
        self._buf = _allocate_for(what, nbytes, self.max_bytes, populate, stop)
        self._np = self._buf.numpy()

    def plan(self, tensors: dict[str, torch.Tensor]) -> list[list[tuple[str, tuple[int, int] | None, int]]]:
        """Waves of (name, row range, nbytes); each wave fits the cap; oversize tensors are cut by rows."""
        cap = self.max_bytes
        waves: list[list[tuple[str, tuple[int, int] | None, int]]] = [[]]
        used = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            pieces: list[tuple[tuple[int, int] | None, int]] = [(None, nbytes)]
            if cap is not None and _round_up(nbytes) > cap and t.dim() > 0 and t.shape[0] > 1:
                row = nbytes // t.shape[0]
                # as many rows as the cap holds once rounded to the arena's alignment (rows of a few bytes made
                # pieces of a thousandth of the cap: 15,629 of 16 KiB for a 256 MB vector, an 11x slower save)
                per = cap // _ALIGN * _ALIGN // max(1, row)
                if per == 0:
                    raise ValueError(f"tensor {name!r} has rows of {row} bytes, more than max_staging_bytes={cap}")
                pieces = [
                    ((a, min(a + per, t.shape[0])), (min(a + per, t.shape[0]) - a) * row)
                    for a in range(0, t.shape[0], per)
                ]
            elif cap is not None and _round_up(nbytes) > cap:
                raise ValueError(f"tensor {name!r} ({nbytes} bytes) does not fit max_staging_bytes={cap}")
            for rows, n in pieces:
                if cap is not None and used + _round_up(n) > cap and waves[-1]:
                    waves.append([])
                    used = 0
                waves[-1].append((name, rows, n))
                used += _round_up(n)
        return waves

    @contextlib.contextmanager
    def _taken(self) -> Iterator[None]:
        """The arena, for a save: a reservation faulting pages in meanwhile stops at its current 4 MiB and hands
        the arena over (its copies fault the rest in), so that a save coming early never waits for all of it."""
        with self._count:
            self._wanted += 1
        try:
            self._lock.acquire()
        finally:  # counted while waiting only: a reservation that starts after this save faults all of it in
            with self._count:
                self._wanted -= 1
        try:
            yield
        finally:
            self._lock.release()

    def reserve(self, sizes: list[int]) -> None:
        """Allocate the arena for tensors of these byte sizes ahead of the first save (within the cap) and fault
        its pages in, unless a save takes it over first."""
        nbytes = sum(_round_up(n) for n in sizes)
        nbytes = nbytes if self.max_bytes is None else min(nbytes, self.max_bytes)
        with self._lock:
            if nbytes > self.capacity:
                stop = lambda: self._wanted > 0 or self._closing  # noqa: E731
                self._grow("the staging arena, reserved ahead of a save", nbytes, True, stop)

    def scratch(self, sizes: list[int]) -> list[torch.Tensor]:
        """Uint8 buffers of these sizes, for a restore to read into before anything reaches the caller: in
        the arena (grown within the cap: the next save then copies into touched memory), else temporary.
        Valid until the next `stage` or `reserve`."""
        need = sum(_round_up(n) for n in sizes)
        with self._lock:
            if self.capacity < need <= (self.max_bytes or need):
                self._grow(SCRATCH, need, populate=False)
            buf = self._buf if need <= self.capacity else _allocate_for(SCRATCH, need, self.max_bytes, False)
        out, off = [], 0
        for n in sizes:
            out.append(buf[off : off + n])
            off += _round_up(n)
        return out

    def stage(
        self,
        tensors: dict[str, torch.Tensor],
        wave: list[tuple[str, tuple[int, int] | None, int]],
        later: Container[str] = (),
    ) -> tuple[list[Staged], list[Copy]]:
        """Lay one wave out in the arena (growing it once if needed) and copy it there, except the tensors named in
        `later`: their copies are returned, for `copy` to make before their views are read. Views stay valid until
        the next stage."""
        with self._taken():
            need = sum(_round_up(n) for _, _, n in wave)
            if need > self.capacity:  # not reserved: the copies below fault the pages in (touching them first
                # doubled the stall: docs/benchmarks.md, run 13)
                self._grow("the staging arena a save copies its tensors into", need, populate=False)
            out, off = [], 0
            now: list[Copy] = []
            deferred: list[Copy] = []
            for name, rows, n in wave:
                src = tensors[name]
                if rows is not None:
                    src = src[rows[0] : rows[1]]
                dst = self._buf[off : off + n]
                if n:
                    (deferred if name in later else now).append((dst, src))
                out.append(Staged(name, rows, self._np[off : off + n]))
                off += _round_up(n)
            copy(now, self._copier)
            return out, deferred


def default_copy_threads() -> int:
    """Threads for a snapshot's copy: the CPUs this process may run on, shared with the other ranks of its node
    (``LOCAL_WORLD_SIZE``, as torchrun sets it), at most 8: memory bandwidth is the bound past that."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // ranks_per_node()))


def copy(copies: list[Copy], pool: ThreadPoolExecutor | Inline = Inline(), piece: int = _PIECE) -> None:
    """Make staged copies; returns once they are in host memory (a CUDA source: its own device synchronized, as
    the calling thread's current device may be another). Host copies are cut into tasks of about `piece` bytes
    (a contiguous tensor past it into pieces, smaller ones grouped) that `pool` runs meanwhile: torch copies on one
    thread under torchrun's ``OMP_NUM_THREADS=1`` (7 GB/s here, against 13 on two: docs/benchmarks.md), and a
    copy inside `save` is the training's stall. A failed copy raises once every task has stopped writing."""
    tasks: list[list[Copy]] = [[]]
    filled = 0
    for dst, src in copies:
        if src.is_cuda:
            dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            continue
        for part in _parts(dst, src, piece):
            tasks[-1].append(part)
            filled += part[1].nbytes
            if filled >= piece:
                tasks.append([])
                filled = 0
    futures = [submit_or_run(pool, _copy_all, task) for task in tasks if task]  # runs here past interpreter exit
    futures_wait(futures)
    for f in futures:
        f.result()
    for device in {src.device for _, src in copies if src.is_cuda}:
        torch.cuda.synchronize(device)


def _parts(dst: torch.Tensor, src: torch.Tensor, piece: int) -> Iterator[Copy]:
    """(destination, source) pairs of like shape that together copy host `src` into the uint8 arena view `dst`."""
    if not src.is_contiguous() or src.nbytes <= piece or src.is_conj() or src.is_neg():  # a lazy conjugate or
        yield dst.view(src.dtype).view(src.shape), src  # negative view has no bytes of its values: copy_ makes them
        return
    flat = src.reshape(-1).view(torch.uint8)
    for lo in range(0, src.nbytes, piece):
        yield dst[lo : lo + piece], flat[lo : lo + piece]


def _copy_all(task: list[Copy]) -> None:
    for dst, src in task:
        dst.copy_(src)
