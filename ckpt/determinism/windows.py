"""Token windows read at the disk's random-read rate: one global stream over token files, read by batch.

Random windows defeat the page cache's read-around: a memory-mapped 4 KiB window costs ~340 KiB of disk reads
(issue 26). Here a batch of windows is read with `O_DIRECT` into page-aligned bounce buffers, so the disk reads
the window's pages and nothing else, and a batch's reads are in flight together (up to 256): through Linux native AIO
(`io_submit` calls of up to 256 reads, built as a numpy array of `struct iocb`, no Python per window), or, where
AIO or `O_DIRECT` is missing (tmpfs, another OS), through a small thread pool of `os.preadv` calls on a file
opened with `POSIX_FADV_RANDOM`. `bench/data_read.py` measures both; AIO is the default.

A window may cross a shard boundary: the stream is the files' concatenation, so such a window is read as one
piece per file it touches and comes out as the tail of one shard followed by the head of the next.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import platform
import stat
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINGERPRINT_BLOCK = 1 << 16
SPARE_BUFFERS = 4
# AIO reads in flight per process, at most: on this machine's disk 256 outstanding 32 KiB reads gave 45,700
# windows/s, 512 gave 28,000, 1,280 gave 17,900 (bench/data_read.py); 4 KiB reads reach fio's best at 256
MAX_INFLIGHT = 256
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers: a page, a multiple of any logical block size
# (io_setup, io_destroy, io_getevents, io_submit) by machine; AIO is used only where the numbers are known
_AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB = np.dtype(
    [
        ("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
        ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
        ("flags", "<u4"), ("resfd", "<u4"),
    ]
)  # fmt: skip
_IO_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert _IOCB.itemsize == 64 and _IO_EVENT.itemsize == 32  # linux/aio_abi.h


def data_fingerprint(path: str | os.PathLike[str], block: int = FINGERPRINT_BLOCK) -> str:
    """Hash of a file's size and its first and last `block` bytes: cheap, and catches a swapped or grown file."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"size={size};block={block};".encode())
    with open(path, "rb") as f:
        digest.update(f.read(block))
        f.seek(max(0, size - block))
        digest.update(f.read(block))
    return digest.hexdigest()[:16]


def resolve_token_files(source: str | bytes | os.PathLike[Any] | Sequence[str | bytes | os.PathLike[Any]]) -> list[str]:
    """The token files of a source, in stream order: a file; a directory's regular non-hidden files sorted by name;
    or a list, in the order given (the caller's order is the stream's)."""
    if isinstance(source, (str, bytes, os.PathLike)):
        path = os.fsdecode(source)
        if not os.path.isdir(path):
            return [path]
        files = sorted(
            os.path.join(path, name)
            for name in os.listdir(path)
            if not name.startswith(".") and os.path.isfile(os.path.join(path, name))
        )
        if not files:
            raise ValueError(f"{path}: directory holds no token files")
        return files
    files = [os.fsdecode(p) for p in source]
    if not files:
        raise ValueError("token file list is empty")
    return files


class TokenStream:
    """Token files concatenated in order into one global stream of tokens of one dtype (shards of a corpus)."""

    def __init__(self, files: Sequence[str], dtype: np.dtype | str) -> None:
        self.files = list(files)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "biuf":
            raise TypeError(f"token dtype must be numeric (e.g. uint16), got {self.dtype}")
        sizes = []
        for path in self.files:
            found = os.stat(path)
            if not stat.S_ISREG(found.st_mode):  # a FIFO would block the fingerprint's read, a device read without end
                raise ValueError(
                    f"{path}: not a regular file (mode {stat.filemode(found.st_mode)}): token files are files"
                )
            size = found.st_size
            if size % self.dtype.itemsize:
                raise ValueError(
                    f"{path}: size {size} is not a multiple of {self.dtype} itemsize {self.dtype.itemsize}"
                )
            sizes.append(size // self.dtype.itemsize)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        # bounds[i] = first global token of file i; bounds[-1] = n_tokens
        self.bounds = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n_tokens = int(self.bounds[-1])

    def fingerprint(self) -> str:
        """One file: `data_fingerprint(file)` (as before shards); several: a hash of each one's, in stream order."""
        if len(self.files) == 1:
            return data_fingerprint(self.files[0])
        digest = hashlib.sha256(f"files={len(self.files)};".encode())
        for path in self.files:
            digest.update(f"{data_fingerprint(path)};".encode())
        return digest.hexdigest()[:16]

    def pieces(self, starts: np.ndarray, window: int) -> _Pieces:
        """Each window [start, start + window) as (window, file, byte offset, byte length, token offset) pieces:
        one per window inside a file, one per touched file for a window across a shard boundary."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() > self.n_tokens - window):  # no int64 overflow
            bad = int(starts.min()) if starts.min() < 0 else int(starts.max())
            raise IndexError(f"window [{bad}, {bad + window}) exceeds the {self.n_tokens} tokens of {self.describe()}")
        item = self.dtype.itemsize
        first = np.searchsorted(self.bounds, starts, side="right") - 1
        last = np.searchsorted(self.bounds, starts + window - 1, side="right") - 1
        inside = first == last
        rows = np.flatnonzero(inside)
        win, fil = rows, first[inside]
        off = (starts[inside] - self.bounds[fil]) * item
        length = np.full(rows.size, window * item, dtype=np.int64)
        dest = np.zeros(rows.size, dtype=np.int64)
        crossing = np.flatnonzero(~inside)
        if crossing.size:  # rare: split at each shard boundary the window spans
            extra: list[tuple[int, int, int, int, int]] = []
            for w in crossing.tolist():
                lo, hi = int(starts[w]), int(starts[w]) + window
                for f in range(int(first[w]), int(last[w]) + 1):
                    a, b = max(lo, int(self.bounds[f])), min(hi, int(self.bounds[f + 1]))
                    if b > a:
                        extra.append((w, f, (a - int(self.bounds[f])) * item, (b - a) * item, a - lo))
            cols = np.asarray(extra, dtype=np.int64).T
            win, fil, off, length, dest = (np.concatenate([x, y]) for x, y in zip((win, fil, off, length, dest), cols))
        return _Pieces(len(starts), win, fil, off, length, dest)

    def describe(self) -> str:
        """The stream in an error message: its file, or the count of its files and the first one."""
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} files ({self.files[0]}, ...)"


@dataclass
class _Pieces:
    """The reads of one batch of windows: per piece, its window (row), file, byte offset and length, and where in
    the window its tokens go."""

    count: int
    window: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    dest: np.ndarray


def _aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer for O_DIRECT reads (an anonymous mmap, freed with the last view of it)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, ALIGN)), dtype=np.uint8, count=nbytes)


@dataclass
class _Batch:
    """A batch of windows being read: its pieces, the bounce buffer they land in, and per-piece results."""

    pieces: _Pieces
    start: np.ndarray  # per piece: byte offset of its read in the bounce buffer
    skew: np.ndarray  # per piece: bytes from the read's start to the piece's first byte (O_DIRECT alignment)
    nbytes: np.ndarray  # per piece: bytes requested
    buffer: np.ndarray
    result: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    remaining: int = 0
    futures: list[Future[None]] = field(default_factory=list)


class WindowReader:
    """Reads batches of windows of a `TokenStream`: `submit(starts)` starts the reads, `collect` waits and
    returns the (batch, window) array; `read` does both. A batch's reads are all in flight at once.

    backend "aio" (Linux native AIO, O_DIRECT; the default where available) or "threads" (`threads` preadv
    workers); `direct` chooses O_DIRECT (read only the windows' pages) or buffered reads with POSIX_FADV_RANDOM
    (no read-ahead, but whole pages through the page cache). One caller at a time: it reopens its files after a
    fork or in a DataLoader worker, never sharing an AIO context or a file offset, and a `TokenWindowDataset` gives
    each thread a reader of its own.
    """

    def __init__(
        self,
        stream: TokenStream,
        window: int,
        *,
        backend: str | None = None,
        direct: bool = True,
        threads: int = 16,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        if backend not in (None, "aio", "threads"):
            raise ValueError(f"backend must be 'aio' or 'threads', got {backend!r}")
        if backend == "aio" and not direct:
            raise ValueError("backend 'aio' needs direct=True (Linux AIO is asynchronous only with O_DIRECT)")
        self.stream, self.window = stream, window
        self.requested_backend, self.direct, self.threads = backend, direct, threads
        self.max_inflight = max_inflight
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the settings only: files, AIO context and threads are per process."""
        keep = ("stream", "window", "requested_backend", "direct", "threads", "max_inflight")
        return {key: self.__dict__[key] for key in keep} | {"_pid": -1}

    # ----- per-process resources ------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        """Open the files (and the AIO context or thread pool) in this process, once."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._inflight: dict[int, _Batch] = {}
        self._next_id = 0
        self._spare: list[np.ndarray] = []  # bounce buffers of collected batches, reused (no fresh pages to fault)
        fds = self._open(direct=self.direct)
        self._direct = self.direct and fds is not None
        if fds is None:  # a filesystem without O_DIRECT (tmpfs): buffered reads without read-ahead
            if self.requested_backend == "aio":
                raise OSError(f"{self.stream.files[0]}: O_DIRECT refused (EINVAL), which backend 'aio' needs")
            fds = self._open(direct=False)
        self._fds = fds
        self._aio = _Aio.create(self.max_inflight) if self._direct and self.requested_backend != "threads" else None
        if self._aio is None and self.requested_backend == "aio":
            raise OSError(f"Linux AIO is not available on {platform.machine()}; use backend='threads'")
        self.backend = "aio" if self._aio else "threads"
        self._pool = None if self._aio else ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-window")
        self._finalizer = _Closer(self._fds, self._aio, self._pool, self._inflight)

    def _open(self, direct: bool) -> list[int] | None:
        """The files opened for reading: with O_DIRECT (None if the filesystem refuses it) or advised
        POSIX_FADV_RANDOM, so the page cache reads no more than the pages asked for."""
        fds: list[int] = []
        for path in self.stream.files:
            try:
                fds.append(os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0)))
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                if direct and e.errno == errno.EINVAL:
                    return None
                raise OSError(e.errno, f"{path}: cannot open for reading: {e.strerror}") from e
            if not direct:
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_RANDOM)
        return fds

    # ----- reading ------------------------------------------------------------------------------------------
    def read(self, starts: np.ndarray | Sequence[int], dtype: np.dtype | type | None = None) -> np.ndarray:
        """The windows at these token starts, as a (len(starts), window) array of `dtype` (default: the stream's)."""
        return self.collect(self.submit(starts), dtype)

    def submit(self, starts: np.ndarray | Sequence[int]) -> int:
        """Start reading the windows at `starts`; returns a ticket for `collect`."""
        self._ensure_open()
        pieces = self.stream.pieces(np.asarray(starts, dtype=np.int64), self.window)
        if self._direct:
            lo = pieces.offset & ~(ALIGN - 1)
            nbytes = ((pieces.offset + pieces.length + ALIGN - 1) & ~(ALIGN - 1)) - lo
            skew = pieces.offset - lo
            start = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
            buffer = self._buffer(int(nbytes.sum()))
        else:
            lo, nbytes, skew = pieces.offset, pieces.length, np.zeros_like(pieces.offset)
            start = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
            buffer = self._buffer(int(nbytes.sum()))
        batch = _Batch(pieces, start, skew, nbytes, buffer)
        batch.result = np.zeros(len(nbytes), dtype=np.int64)
        batch.remaining = len(nbytes)
        ticket = self._next_id
        self._next_id += 1
        self._inflight[ticket] = batch
        fds = np.asarray(self._fds, dtype=np.int64)[pieces.file]
        if self._aio is not None:
            self._aio.submit(ticket, batch, fds, lo, self._inflight)
        else:
            chunks = np.array_split(np.arange(len(nbytes)), min(self.threads, max(1, len(nbytes))))
            batch.futures = [
                self._pool.submit(_pread_all, fds[c], lo[c], nbytes[c], buffer, start[c], batch.result, c)
                for c in chunks
            ]
        return ticket

    def collect(self, ticket: int, dtype: np.dtype | type | None = None) -> np.ndarray:
        """Wait for a submitted batch and return its windows as `dtype` (default: the stream's), checking every
        read returned its bytes."""
        batch = self._inflight[ticket]
        try:
            if self._aio is not None:
                while batch.remaining:
                    self._aio.reap(self._inflight, 1)
            else:
                for future in batch.futures:
                    future.result()
        finally:
            del self._inflight[ticket]
        return self._assemble(batch, np.dtype(dtype or self.stream.dtype))

    def drain(self) -> None:
        """Wait for every batch in flight and drop it (before a read that the prefetch did not foresee)."""
        if self._pid != os.getpid():
            return
        for ticket in list(self._inflight):
            try:
                self.collect(ticket)
            except OSError:
                pass  # a prefetched batch nobody asked for: its error belongs to no one

    def _assemble(self, batch: _Batch, dtype: np.dtype) -> np.ndarray:
        """Check each piece's read and copy the windows out of the bounce buffer into a new array of `dtype`: one
        copy per piece that also converts, so a token batch widened to int64 is written once (a gather and then
        an `astype` cost a third more at 32 KiB windows)."""
        p = batch.pieces
        need = batch.skew + p.length
        short = np.flatnonzero(batch.result < need)
        if short.size:
            k = int(short[0])
            got = int(batch.result[k])
            path = self.stream.files[int(p.file[k])]
            what = os.strerror(-got) if got < 0 else f"{got} bytes"
            raise OSError(
                f"{path}: read at byte {int(p.offset[k]) - int(batch.skew[k])}: expected {int(need[k])} bytes, got {what}"
            )
        item = self.stream.dtype.itemsize
        tokens = batch.buffer.view(self.stream.dtype)
        first = (batch.start + batch.skew) // item  # each piece's first token in the buffer
        out = np.empty((p.count, self.window), dtype=dtype)
        pieces = zip(p.window.tolist(), p.dest.tolist(), (p.length // item).tolist(), first.tolist())
        for row, dest, n, at in pieces:
            out[row, dest : dest + n] = tokens[at : at + n]
        self._spare = [batch.buffer, *self._spare][:SPARE_BUFFERS]
        return out

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A page-aligned bounce buffer of `nbytes`: a spare one that is large enough, else a new one."""
        for k, spare in enumerate(self._spare):
            if spare.nbytes >= nbytes:
                return self._spare.pop(k)[:nbytes]
        return _aligned_buffer(nbytes)


def _pread_all(
    fds: np.ndarray,
    offsets: np.ndarray,
    nbytes: np.ndarray,
    buffer: np.ndarray,
    starts: np.ndarray,
    result: np.ndarray,
    which: np.ndarray,
) -> None:
    """Read pieces `which` with preadv into their places in `buffer`; result = bytes read or -errno (a pool
    thread; the GIL is released inside each call, so the pool's reads overlap)."""
    view = memoryview(buffer)
    for k, fd, off, n, at in zip(which.tolist(), fds.tolist(), offsets.tolist(), nbytes.tolist(), starts.tolist()):
        got = 0
        try:
            while got < n:
                r = os.preadv(fd, [view[at + got : at + n]], off + got)
                if r == 0:
                    break
                got += r
            result[k] = got
        except OSError as e:
            result[k] = -e.errno


class _Aio:
    """A Linux native AIO context driven through raw syscalls (ctypes): batch submit, batch reap."""

    def __init__(self, libc: ctypes.CDLL, numbers: tuple[int, int, int, int], ctx: int, capacity: int) -> None:
        self._libc, self._setup, self._destroy, self._getevents, self._submit = libc, *numbers
        self.ctx, self.capacity, self.free = ctx, capacity, capacity
        self._events = np.zeros(capacity, dtype=_IO_EVENT)
        self._keep: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # ticket -> its iocbs and pointers, until reaped

    @classmethod
    def create(cls, capacity: int) -> _Aio | None:
        """A context for `capacity` reads in flight, or None where Linux AIO is missing or refused."""
        numbers = _AIO_SYSCALLS.get(platform.machine())
        if numbers is None or not hasattr(os, "O_DIRECT"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ctx = ctypes.c_ulong(0)
        if libc.syscall(ctypes.c_long(numbers[0]), ctypes.c_long(capacity), ctypes.byref(ctx)) != 0:
            return None
        return cls(libc, numbers, ctx.value, capacity)

    def submit(
        self, ticket: int, batch: _Batch, fds: np.ndarray, offsets: np.ndarray, inflight: dict[int, _Batch]
    ) -> None:
        """Submit all of the batch's reads (iocbs built by numpy; data = ticket << 32 | piece), as few io_submit
        calls as the ring's free slots allow."""
        n = len(offsets)
        iocbs = np.zeros(n, dtype=_IOCB)
        iocbs["data"] = (np.uint64(ticket) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
        iocbs["fildes"] = fds
        iocbs["buf"] = batch.buffer.ctypes.data + batch.start
        iocbs["nbytes"] = batch.nbytes
        iocbs["offset"] = offsets  # opcode 0 = IOCB_CMD_PREAD
        pointers = iocbs.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(_IOCB.itemsize)
        self._keep[ticket] = (iocbs, pointers)
        done = 0
        while done < n:  # at most `free` at a time: a batch larger than the ring waits for room as reads finish
            if not self.free:
                self.reap(inflight, 1)
            count = min(self.free, n - done)
            got = self._libc.syscall(
                ctypes.c_long(self._submit),
                ctypes.c_ulong(self.ctx),
                ctypes.c_long(count),
                ctypes.c_void_p(pointers.ctypes.data + done * 8),
            )
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EAGAIN and self.free < self.capacity:  # queue full: take completions, go on
                    self.reap(inflight, 1)
                    continue
                raise OSError(err, f"io_submit of {count} reads failed: {os.strerror(err)}")
            done += got
            self.free -= got

    def reap(self, inflight: dict[int, _Batch], min_nr: int) -> None:
        """Wait for at least `min_nr` completions and record each in its batch."""
        got = -1
        while got < 0:
            got = self._libc.syscall(
                ctypes.c_long(self._getevents),
                ctypes.c_ulong(self.ctx),
                ctypes.c_long(min_nr),
                ctypes.c_long(self.capacity),
                ctypes.c_void_p(self._events.ctypes.data),
                ctypes.c_void_p(None),
            )
            if got < 0 and ctypes.get_errno() != errno.EINTR:
                raise OSError(ctypes.get_errno(), f"io_getevents failed: {os.strerror(ctypes.get_errno())}")
        events = self._events[:got]
        tickets = (events["data"] >> np.uint64(32)).astype(np.int64)
        pieces = (events["data"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        self.free += got
        for ticket in np.unique(tickets).tolist():
            sel = tickets == ticket
            batch = inflight[ticket]
            batch.result[pieces[sel]] = events["res"][sel]
            batch.remaining -= int(sel.sum())
            if not batch.remaining:
                self._keep.pop(ticket, None)

    def close(self) -> None:
        """io_destroy: cancels or waits for every read in flight, so no buffer is written after it is freed."""
        if self.ctx:
            self._libc.syscall(ctypes.c_long(self._destroy), ctypes.c_ulong(self.ctx))
            self.ctx = 0


class _Closer:
    """Releases a reader's per-process resources when the reader is collected, buffers last."""

    def __init__(
        self, fds: list[int], aio: _Aio | None, pool: ThreadPoolExecutor | None, inflight: dict[int, _Batch]
    ) -> None:
        self.pid, self.fds, self.aio, self.pool, self.inflight = os.getpid(), fds, aio, pool, inflight

    def __del__(self) -> None:
        if self.pid != os.getpid():
            return  # a forked copy: the parent owns these
        if self.aio is not None:
            self.aio.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.inflight.clear()
