"""A rank's pack (format ckpt/5): every box it writes placed back to back in a few large files, and the verified
reads of ranges of them.

A pack is a zarr3 array of bytes (uint8, 1-D, codec `bytes` alone) whose chunks are its files, at most
`format.PACK_FILES` per rank: tensorstore reads it like any array. The manifest says where each box's bytes are
(`ArrayInfo.places`) and their crc32c (`ArrayInfo.digests`, one per box), so a read of one tensor reads its bytes
alone, and every byte a restore uses is checked against the manifest. The packs of ckpt/3-4 (small whole tensors,
each in one chunk, chunk files with a crc32c trailer) are read the same way.

Writes stream the staged pieces in increasing offset order: into O_DIRECT chunk files where the root has direct
file IO (`chunk_files`), else into one buffer per chunk, each written through tensorstore once full.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import crc32c

from ._lazy import numpy as np
from ._lazy import tensorstore as ts
from .chunk_files import ChunkFile, ChunkWriter
from .errors import CorruptCheckpointError
from .format import ArrayInfo, chunk_key
from .pools import Inline
from .storage import Storage, UnsafeFileError, open_regular, where

GROUP_BYTES = 16 << 20  # segments of small boxes are read together up to this many bytes by one call
COALESCE = 64 << 10  # ... when they lie this close to each other in a file


class PackWriter:
    """Writes one rank's pack from the pieces of its placed boxes, fed in increasing offset order, and computes
    the crc32c of each segment of each box on the way (`digests`: array name -> digest index -> crc32c).

    `files`: the chunk writer of a root with direct file IO, `path` then the pack's local directory; otherwise
    `array` (the pack's opened tensorstore array) receives each chunk as its buffer fills."""

    def __init__(
        self,
        pack: ArrayInfo,
        path: str,
        files: ChunkWriter | None,
        array: Callable[[], ts.TensorStore],
        *,
        reference: bool,
    ):
        self.pack, self.path, self.files, self.array, self.reference = pack, path, files, array, reference
        self.size = pack.chunk[0]  # bytes of one chunk file
        self.at = 0  # bytes of the pack written so far
        self.digests: dict[str, dict[int, int]] = {}
        self.futures: list[ts.WriteFutures] = []  # the buffered chunks' writes
        self._fed: dict[tuple[str, int], int] = {}  # (array, box) -> its bytes fed so far
        self._partial: dict[tuple[str, int], int] = {}  # (array, box) -> crc32c of its segment begun, not ended
        self._file: ChunkFile | None = None
        self._buffer: np.ndarray | None = None

    def feed(self, info: ArrayInfo, box: int, offset: int, data: memoryview) -> None:
        """Bytes of box `box` of `info`, at byte `offset` of the box (a box's pieces in order)."""
        key, end = (info.name, box), offset + len(data)
        if offset != self._fed.get(key, 0):
            raise RuntimeError(
                f"pack {self.pack.name!r}: box {box} of {info.name!r} fed at {offset}, expected {self._fed.get(key, 0)}"
            )
        self._fed[key] = end
        self._put(info.places[box][1] + offset, data)
        for lo, hi, index in info.segments(box, offset, end):
            value = crc32c.crc32c(data[max(lo, offset) - offset : min(hi, end) - offset], self._partial.pop(key, 0))
            if end < hi:
                self._partial[key] = value
            else:
                self.digests.setdefault(info.name, {})[index] = value

    def finish(self) -> None:
        """Pad the last chunk to its full size and close it; every box must have been fed whole."""
        if self._partial:
            raise RuntimeError(f"pack {self.pack.name!r}: boxes left incomplete: {sorted(self._partial)[:3]}")
        files = -(-self.pack.shape[0] // self.size)
        self._put(files * self.size, memoryview(b""))

    def close(self) -> None:
        """Give up (the save failed): close the open chunk file; the step directory is removed by its owner."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _put(self, at: int, data: memoryview) -> None:
        """Bytes at pack offset `at` (zeros fill any gap since the last), cut at chunk boundaries."""
        if at < self.at:
            raise RuntimeError(f"pack {self.pack.name!r}: bytes at {at} come after {self.at}")
        while self.at < at:  # a gap: alignment, or the last chunk's padding
            n = min(at, (self.at // self.size + 1) * self.size) - self.at
            self._write(memoryview(b""), n)
        while len(data):
            n = min(len(data), (self.at // self.size + 1) * self.size - self.at)
            self._write(data[:n], 0)
            data = data[n:]

    def _write(self, data: memoryview, zeros: int) -> None:
        """Bytes (or `zeros` zero bytes) into the current chunk, which they never cross; a full chunk is closed."""
        k, within = divmod(self.at, self.size)
        if within == 0:
            self._open(k)
        if self._file is not None:
            self._file.feed(data) if len(data) else self._file.pad(zeros)
        elif len(data):
            self._buffer[within : within + len(data)] = np.frombuffer(data, np.uint8)
        self.at += len(data) or zeros
        if self.at % self.size == 0:
            self._close(k)

    def _open(self, k: int) -> None:
        if self.files is not None:
            self._file = ChunkFile(os.path.join(self.path, chunk_key((k,))), self.files, self.size, trailer=False)
        else:
            self._buffer = np.zeros(self.size, np.uint8)

    def _close(self, k: int) -> None:
        if self._file is not None:
            self._file.finish()
            self.files.written(self._file.path)
            self._file = None
            return
        lo, hi = k * self.size, min((k + 1) * self.size, self.pack.shape[0])  # tensorstore pads the edge chunk
        buffer, self._buffer = self._buffer, None
        self.futures.append(
            self.array()[lo:hi].write(buffer[: hi - lo], can_reference_source_data_indefinitely=self.reference)
        )


@dataclass
class BoxRead:
    """Bytes [lo, hi) of placed box `box` of `info` (segment-aligned: `ArrayInfo.segments`) into `dest` (a writable
    byte view of that size), once `ready()` allows (its target copied aside first); `landed(n)` is told each of its
    segments' bytes once they verified."""

    info: ArrayInfo
    box: int
    lo: int
    hi: int
    dest: memoryview
    ready: Callable[[], None] = lambda: None
    landed: Callable[[int], None] = lambda n: None


Segment = tuple[BoxRead, int, int, int]  # (read, first byte in the box, end byte, digest index)


def read_boxes(
    storage: Storage,
    packs: dict[str, ArrayInfo],
    path_of: Callable[[str], str],
    reads: Sequence[BoxRead],
    pool: Any,
    *,
    step: int | None,
) -> list[Future]:
    """Submit the reads of placed boxes, segment by segment, each checked against its digest in the manifest as it
    lands: a large box on several threads (a task per segment), segments of small boxes close to each other in a file
    by one call.
    `path_of(pack name)`: the pack's directory, relative to the root."""
    by_file: dict[tuple[str, int], list[tuple[int, Segment]]] = {}  # (pack, chunk) -> (offset in it, segment)
    alone: list[Segment] = []  # segments across two files
    for r in reads:
        pack = packs[r.info.places[r.box][0]]
        for lo, hi, index in r.info.segments(r.box, r.lo, r.hi):
            start = r.info.places[r.box][1] + lo
            k, within = divmod(start, pack.chunk[0])
            if within + hi - lo > pack.chunk[0]:
                alone.append((r, lo, hi, index))
            else:
                by_file.setdefault((pack.name, k), []).append((within, (r, lo, hi, index)))
    futures = [pool.submit(_read_segments, storage, packs, path_of, [s], step) for s in alone]
    for segments in by_file.values():
        segments.sort(key=lambda s: s[0])
        group: list[Segment] = []
        end = start = 0
        for within, seg in segments:
            n = seg[2] - seg[1]
            if group and (within - end > COALESCE or within + n - start > GROUP_BYTES):
                futures.append(pool.submit(_read_segments, storage, packs, path_of, group, step))
                group = []
            if not group:
                start = within
            group.append(seg)
            end = within + n
        futures.append(pool.submit(_read_segments, storage, packs, path_of, group, step))
    return futures


def _read_segments(
    storage: Storage,
    packs: dict[str, ArrayInfo],
    path_of: Callable[[str], str],
    group: list[Segment],
    step: int | None,
) -> None:
    """Read segments that lie close together in one file with one call (or one segment across files), then check
    each against its digest."""
    for r, _, _, _ in group:
        r.ready()
    spans: list[tuple[str, int, int, memoryview]] = []  # (file path, offset in it, bytes, destination)
    for r, lo, hi, _ in group:
        pack = packs[r.info.places[r.box][0]]
        at, size = r.info.places[r.box][1] + lo, pack.chunk[0]
        dest = r.dest[lo - r.lo : hi - r.lo]
        while len(dest):
            k, within = divmod(at, size)
            n = min(len(dest), size - within)
            spans.append((f"{path_of(pack.name)}/{chunk_key((k,))}", within, n, dest[:n]))
            dest, at = dest[n:], at + n
    names = [r.info.name for r, _, _, _ in group]
    pack = packs[group[0][0].info.places[group[0][0].box][0]]
    by_file: dict[str, list[tuple[str, int, int, memoryview]]] = {}
    for span in spans:  # one pass: a manifest's segment size decides how many there are
        by_file.setdefault(span[0], []).append(span)
    for path, in_file in by_file.items():
        _read_spans(storage, path, in_file, pack, names, step)
    for r, lo, hi, index in group:
        value = crc32c.crc32c(r.dest[lo - r.lo : hi - r.lo])
        if r.info.digests is not None and value != r.info.digests[index]:
            at = r.info.places[r.box][1] + lo
            raise CorruptCheckpointError(
                f"placed tensor checksum (crc32c) mismatch: the manifest expects {r.info.digests[index]:08x}, bytes "
                f"[{lo}, {hi}) of its box {r.box} (at offset {at} of pack {pack.name!r}) hold {value:08x}",
                step=step,
                key=r.info.name,
                file=where(storage, f"{path_of(pack.name)}/{chunk_key((at // pack.chunk[0],))}"),
            )
        r.landed(hi - lo)


def _read_spans(
    storage: Storage,
    path: str,
    spans: list[tuple[str, int, int, memoryview]],
    pack: ArrayInfo,
    names: list[str],
    step: int | None,
) -> None:
    """Ranges of one file, in increasing order, into their destinations: one preadv (the gaps read and dropped)
    from a local file, else one ranged read."""
    lo, hi = spans[0][1], spans[-1][1] + spans[-1][2]
    local = storage.direct_path(path)
    if local is not None:
        views, at = [], lo
        for _, within, n, dest in spans:
            if within > at:
                views.append(memoryview(bytearray(within - at)))
            views.append(dest)
            at = within + n
        fd = _open(local, pack, names, step)
        try:
            _preadv_exact(fd, views, lo, pack, names, step, local)
        finally:
            os.close(fd)
        return
    data = storage.read_range(path, lo, hi)
    file = where(storage, path)
    if data is None:
        raise CorruptCheckpointError("pack file is missing", step=step, key=_key(pack, names), file=file)
    if len(data) != hi - lo:
        raise CorruptCheckpointError(
            f"pack file ends before byte {hi} (pack {pack.name!r})", step=step, key=_key(pack, names), file=file
        )
    for _, within, n, dest in spans:
        dest[:] = data[within - lo : within - lo + n]


def _key(pack: ArrayInfo, names: list[str]) -> str:
    """The key an error names: the tensor, when the read was of one."""
    return names[0] if len(set(names)) == 1 else pack.name


def _open(path: str, pack: ArrayInfo, names: list[str], step: int | None) -> int:
    """A pack file opened for the exact ranges a read asks for. The kernel's read-ahead is turned off
    (`POSIX_FADV_RANDOM`): a range that ends inside the file would otherwise pull up to `read_ahead_kb` more from
    the disk (8 MiB on some machines, more on network file systems) for bytes no one asked for, as when
    `ckpt.load(keys=...)` reads one tensor out of a pack; each read is one large preadv, so nothing is lost."""
    try:
        fd = open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptCheckpointError("pack file is missing", step=step, key=_key(pack, names), file=path) from None
    except UnsafeFileError as e:
        raise CorruptCheckpointError(
            f"pack file is {e.strerror}", step=step, key=_key(pack, names), file=path
        ) from None
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # advice only: a file system that refuses it reads as before
            pass
    return fd


def _preadv_exact(
    fd: int, views: list[memoryview], offset: int, pack: ArrayInfo, names: list[str], step: int | None, path: str
) -> None:
    """Fill every view from the file at `offset` on, in order (preadv, resumed after a short read)."""
    views = [v for v in views if len(v)]
    i = 0  # the first view not yet filled (no pop(0): a manifest's segment size decides how many views there are)
    while i < len(views):
        n = os.preadv(fd, views[i : i + 512], offset)  # IOV_MAX is 1024 on Linux
        if n <= 0:
            raise CorruptCheckpointError(
                f"pack file ends at byte {offset} (pack {pack.name!r})", step=step, key=_key(pack, names), file=path
            )
        offset += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def files_needed(pack: ArrayInfo, start: int, n: int) -> range:
    """The chunk indices of a pack that bytes [start, start + n) lie in."""
    return range(start // pack.chunk[0], (start + n - 1) // pack.chunk[0] + 1)


def verify_box(storage: Storage, pack: ArrayInfo, path: str, info: ArrayInfo, box: int, *, step: int | None) -> None:
    """Read one placed box segment by segment and check each against the manifest (`verify`: one segment in memory
    at a time)."""
    for lo, hi, _ in info.segments(box):
        read = BoxRead(info, box, lo, hi, memoryview(bytearray(hi - lo)))
        for f in read_boxes(storage, {pack.name: pack}, lambda _: path, [read], Inline(), step=step):
            f.result()


def check_sizes(storage: Storage, path: str, pack: ArrayInfo, *, step: int | None) -> None:
    """Every file of a pack is there at its exact size (the bytes no box covers, padding, are checked no further)."""
    n = pack.file_nbytes
    for k in range(-(-pack.shape[0] // pack.chunk[0])):
        file_path = f"{path}/{chunk_key((k,))}"
        try:
            tail = storage.read_range(file_path, n - 1, None)  # its last byte, and nothing after it
        except UnsafeFileError as e:
            raise CorruptCheckpointError(
                f"pack file is {e.strerror}", step=step, key=pack.name, file=where(storage, file_path)
            ) from None
        if tail is None or len(tail) != 1:
            raise CorruptCheckpointError(
                "pack file is missing"
                if tail is None
                else f"pack file has {'fewer' if not tail else 'more'} than the {n} bytes expected",
                step=step,
                key=pack.name,
                file=where(storage, file_path),
            )
