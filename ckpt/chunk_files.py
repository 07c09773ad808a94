"""Chunk files of a local root, written straight from the staging arena: one thread, O_DIRECT where allowed.

Why not through tensorstore: on 2 cores (docs/benchmarks.md, `bench/interference.py`) tensorstore's pool
copies each chunk into a buffer of its own and then into the page cache, on several threads: ~0.5-1 CPU-s
per GiB that the training thread has to compete for. Here a chunk costs its crc32c, computed once for the
file's trailer and the manifest's digest alike, and a DMA from the arena (`O_DIRECT`, for files of at least
`DIRECT_MIN`: no page-cache copy, no writeback, no page cache filled with checkpoint bytes), all on the calling
thread; the fsyncs, which mostly wait for the disk, overlap on a few threads. The bytes are zarr3's (`format.zarr_metadata`: codecs `bytes` +
`crc32c`): the chunk's raw bytes, zero-padded at the array's edge, then their crc32c, little endian.
Tensorstore still creates every array (its zarr.json) and reads these files like its own
(tests/test_ckpt_chunk_files.py); object stores and the memory root are written through it.

A persist (`persist.py`) copies a local tier's chunk files into a local durable root the same way.

Only row-chunked arrays written in whole rows qualify (`store.direct_rows`, the same test the direct reads
use): a chunk is then one contiguous run of the staged bytes.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c

from ._lazy import numpy as np
from .format import ArrayInfo, chunk_key
from .pools import submit_or_run

ALIGN = 4096  # O_DIRECT: address, offset and length in multiples of this (every block size up to 4 KiB)
PIECE = 8 << 20  # bytes per write call: the bounce buffer's size
DIRECT_MIN = 1 << 20  # smaller files are written through the page cache: O_DIRECT would only add system calls
_ZEROS = memoryview(bytes(PIECE))  # the zero padding of edge chunks


class ChunkFile:
    """One chunk file written from pieces that arrive in order (a chunk may span staging waves); without `trailer`
    (a ckpt/5 pack's: the manifest's digests of its boxes cover it) its bytes alone, no crc32c computed."""

    def __init__(self, path: str, writer: "ChunkWriter", size: int, trailer: bool = True):
        self.path, self.writer, self.trailer = path, writer, trailer
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fd, self.direct = writer.open(path, direct=size >= DIRECT_MIN)
        self.offset = 0  # bytes on disk so far (a multiple of ALIGN while direct)
        self.carry = bytearray()  # bytes not yet written: less than ALIGN of them while direct
        self.crc = 0

    def feed(self, data: memoryview) -> None:
        """Append bytes to the chunk's content."""
        if self.trailer:
            self.crc = crc32c.crc32c(data, self.crc)
        if not self.direct:
            self._pwrite(data)
            return
        if self.carry:
            take = min(ALIGN - len(self.carry), len(data))
            self.carry += data[:take]
            data = data[take:]
            if len(self.carry) < ALIGN:
                return
            self._pwrite_aligned(memoryview(self.carry))
            self.carry = bytearray()
        whole = len(data) // ALIGN * ALIGN
        for at in range(0, whole, PIECE):
            self._pwrite_aligned(data[at : min(at + PIECE, whole)])
        self.carry += data[whole:]

    def pad(self, nbytes: int) -> None:
        """Append `nbytes` zeros (the edge chunk's padding to the full chunk shape)."""
        while nbytes:
            n = min(nbytes, PIECE)
            self.feed(_ZEROS[:n])
            nbytes -= n

    def finish(self) -> int:
        """Write what is left and the crc32c trailer; returns the content's crc32c (the manifest's digest)."""
        tail = bytes(self.carry) + (self.crc.to_bytes(4, "little") if self.trailer else b"")
        self.carry = bytearray()
        self._buffered()
        self._pwrite(memoryview(tail))
        os.close(self.fd)
        self.fd = -1
        return self.crc

    def close(self) -> None:
        """Give up on this file (the save failed); the step directory is removed by its owner."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _pwrite_aligned(self, data: memoryview) -> None:
        """An aligned run of bytes, straight from memory when it is aligned there too, else via the bounce buffer."""
        if _address(data) % ALIGN:
            bounce = self.writer.bounce(len(data))
            ctypes.memmove(_address(bounce), _address(data), len(data))  # releases the GIL
            data = bounce
        try:
            self._pwrite(data)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.writer.direct = False  # the filesystem took O_DIRECT at open but not this write: go buffered
            self._buffered()
            self._pwrite(data)

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def _pwrite(self, data: memoryview) -> None:
        while len(data):
            n = os.pwrite(self.fd, data, self.offset)
            if n == 0:
                raise OSError(errno.EIO, "write made no progress", self.path)
            self.offset += n
            data = data[n:]


class ChunkWriter:
    """Writes the chunk files of one save into a local root; each finished file is fsync'd on `fsyncs`."""

    def __init__(self, fsyncs: ThreadPoolExecutor):
        self.direct = hasattr(os, "O_DIRECT")  # cleared for good by a filesystem that refuses it
        self._sync = fsyncs  # the owner's: it outlives this writer
        self._syncs: list[Future] = []
        self._partial: dict[str, ChunkFile] = {}  # path -> a chunk whose remaining rows come in a later wave
        self._bounce = threading.local()  # a buffer per thread (`copy` may run on several)

    def open(self, path: str, direct: bool = True) -> tuple[int, bool]:
        """Create (truncate) a chunk file for writing; (fd, whether it is opened with O_DIRECT)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if direct and self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs before Linux 6.6)
                    raise
                self.direct = False
        return os.open(path, flags, 0o644), False

    def bounce(self, nbytes: int) -> memoryview:
        """An aligned buffer for source bytes that are not aligned in memory."""
        if not hasattr(self._bounce, "buf"):
            self._bounce.buf = mmap.mmap(-1, PIECE)
        return memoryview(self._bounce.buf)[:nbytes]

    def write(self, array_dir: str, info: ArrayInfo, rows: tuple[int, int], data: np.ndarray) -> dict[int, int]:
        """Write rows [a, b) of a row-chunked array (`data`: their bytes, C order) into its chunk files; returns
        the digest of each chunk this completed, by its ordinal. A chunk whose last rows are not among them stays
        open for the next call (its rows must come next, in order)."""
        raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        row, (a, b) = info.row_nbytes, rows
        done = {}
        for index, first, end in info.row_chunks(rows):
            path = os.path.join(array_dir, chunk_key(index))
            f = self._partial.pop(path, None)
            try:
                f = f or ChunkFile(path, self, info.chunk_nbytes + 4)
                lo, hi = max(a, first), min(b, end)
                f.feed(raw[(lo - a) * row : (hi - a) * row])
                if hi < end:
                    self._partial[path] = f
                    continue
                f.pad(info.chunk_nbytes - (end - first) * row)
                done[info.ordinal(index)] = f.finish()
            except OSError as e:
                if f is not None:
                    f.close()
                raise OSError(e.errno, f"{e.strerror} (chunk {index} of array {info.name!r})", path) from None
            self.written(path)
        return done

    def written(self, path: str) -> None:
        """A chunk file finished elsewhere (`packs.PackWriter`): make it durable with the others."""
        self._syncs.append(submit_or_run(self._sync, _fsync, path))

    def copy(self, path: str, data: bytes) -> None:
        """Write a whole chunk file whose bytes (content + crc32c trailer) were read and checked elsewhere (a
        persist's copy of a local tier's file); its trailer is computed again on the way, and must agree."""
        f = None
        try:
            f = ChunkFile(path, self, len(data))
            f.feed(memoryview(data)[:-4])
            if f.finish().to_bytes(4, "little") != data[-4:]:
                raise OSError(errno.EIO, "chunk bytes changed while being copied", path)
        except OSError as e:
            if f is not None:
                f.close()
            raise OSError(e.errno, e.strerror, path) from None
        self.written(path)

    def close(self) -> None:
        """Wait until every written file is durable (raising the first error)."""
        try:
            errors = [e for e in map(Future.exception, self._syncs) if e is not None]  # waits for each
            if errors:
                raise errors[0]
            if self._partial:
                raise RuntimeError(f"chunk files left incomplete: {sorted(self._partial)[:3]}")
        finally:
            for f in self._partial.values():
                f.close()
            self._partial.clear()


def _fsync(path: str) -> None:
    """Make a finished chunk file durable (its data; the directory entries are synced at the commit)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _address(data: memoryview | mmap.mmap) -> int:
    """Where a buffer's bytes start in memory."""
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0
