"""Array IO: writes through tensorstore (zarr3), verified reads of chunk files, and chunk digests.

Writes reference the staging arena without copying (`can_reference_source_data_indefinitely`; not on
the memory kvstore, which would keep the reference): the arena stays untouched until every write
future of the save has resolved; meanwhile the digest of every
chunk is computed from the same staged bytes. Reads never go through zarr.json: with the codecs
`bytes` (little endian) + `crc32c` that the manifest fixes, a chunk file is the raw bytes of a block of
the array (edge blocks zero-padded) followed by their crc32c, so each chunk is read as bytes, checked
(size, crc32c, the manifest's digest), and only then placed. Local chunk files of row-chunked arrays go
straight into the destination with `preadv`; anything else is read whole and copied out.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import crc32c

from ._lazy import numpy as np
from ._lazy import tensorstore as ts
from ._lazy import torch
from .errors import CorruptCheckpointError
from .format import ArrayInfo, chunk_key, numpy_dtype, zarr_metadata, zarr_mismatch
from .storage import Storage, UnsafeFileError, open_regular, where

Box = tuple[tuple[int, int], ...]


def create(kvstore: dict[str, Any], info: ArrayInfo, context: ts.Context) -> ts.Future:
    """Create (or open, when another rank created it) the zarr3 array described by `info`."""
    return ts.open(
        {
            "driver": "zarr3",
            "kvstore": kvstore,
            "metadata": zarr_metadata(info.dtype, info.shape, info.chunk, not info.raw),
            "create": True,
            "open": True,
            "store_data_equal_to_fill_value": True,
        },
        context=context,
    )


def write(
    array: ts.TensorStore, box: Iterable[tuple[int, int]], data: np.ndarray, *, reference: bool
) -> ts.WriteFutures:
    """Write `data` (viewing staged bytes) into a box of the global array; with `reference`, without a copy.

    Only where the kvstore lets go of the data once written: the memory kvstore keeps what it is given,
    so referencing the arena would let the next snapshot rewrite a committed step.
    """
    index = tuple(slice(a, b) for a, b in box)
    return array[index].write(data, can_reference_source_data_indefinitely=reference)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's memory."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def typed(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """View raw staged bytes as the array's numpy dtype and shape."""
    return raw.view(numpy_dtype(dtype)).reshape(shape)


class ChunkDigests:
    """The crc32c of every chunk one writer writes, computed from its staged bytes as zarr lays them out:
    C order within the chunk, edge chunks zero-padded to the full chunk shape. Row bands may arrive in
    several pieces (staging waves), in row order; a chunk's digest is complete at its last row."""

    def __init__(self) -> None:
        self.done: dict[str, dict[int, int]] = {}
        self._partial: dict[tuple[str, int], int] = {}

    def add(self, info: ArrayInfo, box: Box, data: np.ndarray) -> None:
        """Feed `data`, the values of `box` (a region of the global array) as staged."""
        done = self.done.setdefault(info.name, {})
        if not info.shape:
            done[0] = crc32c.crc32c(_raw(data))
            return
        lo_row = box[0][0]
        for index in info.chunks(box):
            first = index[0] * info.chunk[0]
            end = min(first + info.chunk[0], info.shape[0])  # last valid row of the chunk, exclusive
            rows = (max(box[0][0], first), min(box[0][1], end))
            valid = [(i * c, min((i + 1) * c, n)) for i, c, n in zip(index[1:], info.chunk[1:], info.shape[1:])]
            band = data[
                (slice(rows[0] - lo_row, rows[1] - lo_row),)
                + tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(valid, box[1:]))
            ]
            if band.shape[1:] != info.chunk[1:]:  # right-edge chunk: zero-pad its columns
                padded = np.zeros((band.shape[0],) + info.chunk[1:], dtype=band.dtype)
                padded[(slice(None),) + tuple(slice(0, n) for n in band.shape[1:])] = band
                band = padded
            key = (info.name, info.ordinal(index))
            crc = crc32c.crc32c(_raw(band), self._partial.pop(key, 0))
            if rows[1] < end:
                self._partial[key] = crc
                continue
            pad = (first + info.chunk[0] - end) * math.prod(info.chunk[1:]) * info.itemsize
            done[key[1]] = crc32c.crc32c(bytes(pad), crc) if pad else crc


def _raw(a: np.ndarray) -> memoryview:
    """The bytes of an array in C order (a view when it is contiguous)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _check(
    data: memoryview,
    stored: int,
    info: ArrayInfo,
    index: tuple[int, ...],
    *,
    step: int | None,
    file: str,
    crc: int | None = None,
) -> None:
    """A chunk's content against its own crc32c, then that crc32c against the manifest's digest."""
    if (crc32c.crc32c(data) if crc is None else crc) != stored:
        raise CorruptCheckpointError("chunk checksum (crc32c) mismatch", step=step, key=info.name, file=file)
    if info.digests is not None and stored != info.digests[info.ordinal(index)]:
        raise CorruptCheckpointError(
            f"chunk digest mismatch: the manifest expects crc32c {info.digests[info.ordinal(index)]:08x}, the file "
            f"holds {stored:08x} (a chunk of another step, run or rank?)",
            step=step,
            key=info.name,
            file=file,
        )


def check_zarr_json(storage: Storage, path: str, info: ArrayInfo, *, step: int | None) -> None:
    """The array's zarr.json must describe exactly the array the manifest lists (the manifest is authoritative)."""
    file = where(storage, f"{path}/zarr.json")
    data = _read_file(storage, f"{path}/zarr.json", info, step=step, what="zarr.json")
    mismatch = zarr_mismatch(data, info)
    if mismatch:
        raise CorruptCheckpointError(f"zarr.json {mismatch}", step=step, key=info.name, file=file)


def _read_file(storage: Storage, path: str, info: ArrayInfo, *, step: int | None, what: str) -> bytes:
    try:
        data = storage.read(path)
    except UnsafeFileError as e:
        raise CorruptCheckpointError(
            f"{what} is {e.strerror}", step=step, key=info.name, file=where(storage, path)
        ) from None
    if data is None:
        raise CorruptCheckpointError(f"{what} is missing", step=step, key=info.name, file=where(storage, path))
    return data


def read_chunks(
    storage: Storage,
    path: str,
    info: ArrayInfo,
    dest: torch.Tensor,
    box: Box,
    pool: ThreadPoolExecutor,
    *,
    step: int | None,
) -> list[Future]:
    """Submit reads of every chunk that holds part of `box`; each is checked, then its part copied into
    `dest` (a contiguous CPU tensor of the box's shape)."""
    out = typed(as_bytes(dest), info.dtype, tuple(b - a for a, b in box))
    return [pool.submit(_read_chunk, storage, path, info, index, out, box, step) for index in info.chunks(box)]


def _read_chunk(
    storage: Storage,
    path: str,
    info: ArrayInfo,
    index: tuple[int, ...],
    out: np.ndarray | None,
    box: Box,
    step: int | None,
) -> None:
    data = read_chunk_file(storage, path, info, index, step=step)
    if out is not None:
        chunk = np.frombuffer(data, dtype=numpy_dtype(info.dtype), count=math.prod(info.chunk)).reshape(info.chunk)
        part = [(max(a, i * c), min(b, (i + 1) * c)) for (a, b), i, c in zip(box, index, info.chunk)]
        out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, box))] = chunk[
            tuple(slice(lo - i * c, hi - i * c) for (lo, hi), i, c in zip(part, index, info.chunk))
        ]


def read_chunk_file(storage: Storage, path: str, info: ArrayInfo, index: tuple[int, ...], *, step: int | None) -> bytes:
    """A chunk file's bytes (content + crc32c), checked: size, its crc32c, the manifest's digest."""
    file_path = f"{path}/{chunk_key(index)}"
    data = _read_file(storage, file_path, info, step=step, what="chunk file")
    if len(data) != info.chunk_nbytes + 4:
        raise CorruptCheckpointError(
            f"chunk file has {len(data)} bytes, expected {info.chunk_nbytes + 4}",
            step=step,
            key=info.name,
            file=where(storage, file_path),
        )
    view = memoryview(data)
    _check(view[:-4], int.from_bytes(view[-4:], "little"), info, index, step=step, file=where(storage, file_path))
    return data


def direct_rows(info: ArrayInfo, box: Box) -> tuple[int, int] | None:
    """The row range of `box` when it can be read straight from chunk files (whole rows, chunk-aligned).

    True of whole arrays and of the row shards of FSDP2, whose boundaries the writer put on chunk
    boundaries; other regions go through `read_chunks`.
    """
    if math.prod(info.shape) == 0 or info.chunk[1:] != info.shape[1:]:
        return None
    if not info.shape:
        return (0, 1)
    if any(a != 0 or b != n for (a, b), n in zip(box[1:], info.shape[1:])):
        return None
    a, b = box[0]
    rows = info.chunk[0]
    if a >= b or a % rows or (b % rows and b != info.shape[0]):
        return None
    return a, b


def read_direct(
    array_dir: str,
    info: ArrayInfo,
    dest: torch.Tensor,
    rows: tuple[int, int],
    pool: ThreadPoolExecutor,
    *,
    step: int | None,
) -> list[Future]:
    """Submit reads of the local chunk files of rows [a, b) straight into `dest`; each checks size, crc32c
    and digest. `dest` must be memory that may hold damaged bytes until every read verified (scratch)."""
    raw = as_bytes(dest)
    row, a = info.row_nbytes, rows[0]
    futures = []
    for index, first, last in info.row_chunks(rows):
        valid = memoryview(raw[(first - a) * row : (last - a) * row])
        futures.append(
            pool.submit(
                _read_direct_chunk,
                os.path.join(array_dir, chunk_key(index)),
                valid,
                info.chunk_nbytes - len(valid),
                info,
                index,
                step,
            )
        )
    return futures


def _read_direct_chunk(
    path: str, valid: memoryview, pad: int, info: ArrayInfo, index: tuple[int, ...], step: int | None
) -> None:
    fd = _open_chunk(path, info, step)
    try:
        size = os.fstat(fd).st_size
        expected = len(valid) + pad + 4
        if size != expected:
            raise CorruptCheckpointError(
                f"chunk file has {size} bytes, expected {expected}", step=step, key=info.name, file=path
            )
        tail = bytearray(pad + 4)
        _pread_exact(fd, valid, 0)
        _pread_exact(fd, memoryview(tail), len(valid))
    finally:
        os.close(fd)
    crc = crc32c.crc32c(tail[:pad], crc32c.crc32c(valid)) if pad else crc32c.crc32c(valid)
    _check(valid, int.from_bytes(tail[pad:], "little"), info, index, step=step, file=path, crc=crc)


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done : done + (1 << 30)]], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}")
        done += n


def read_packed(
    storage: Storage,
    path: str,
    pack: ArrayInfo,
    members: list[tuple[ArrayInfo, torch.Tensor | None, Box | None]],
    *,
    step: int | None,
    check_chunk: bool = True,
) -> None:
    """Read packed tensors that lie in one chunk of the pack array at `path`. Each is checked against its own digest
    in the manifest (an error names its key), then the `box` of it copied into `dest` (None: checked only).

    With `check_chunk` the pack chunk is read whole, once for all of them, and checked as `verify` checks it (size,
    its crc32c, the manifest's digest of it): a packed tensor's digest is the manifest's word alone, the chunk's
    crc32c is also the file's. Without (the chunk was checked already, or the caller checks it itself), a local
    chunk file (`direct_path`) gives only their bytes (pread), any other root the chunk once."""
    index = members[0][0].packed_at(pack)[0]
    file_path = f"{path}/{chunk_key(index)}"
    local, first = storage.direct_path(file_path), members[0][0]
    file = where(storage, file_path)
    expected = pack.chunk_nbytes + 4
    if check_chunk or local is None:
        data = _read_file(storage, file_path, first, step=step, what="pack chunk file")
        if len(data) != expected:
            raise CorruptCheckpointError(
                f"pack chunk file has {len(data)} bytes, expected {expected}", step=step, key=first.name, file=file
            )
        view = memoryview(data)
        for info, dest, box in members:
            at = info.packed_at(pack)[1]
            _place(view[at : at + info.nbytes], info, dest, box, step=step, file=file)
        if check_chunk:
            _check_pack_chunk(view, pack, index, [info.name for info, _, _ in members], step=step, file=file)
        return
    fd = _open_chunk(local, first, step)
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise CorruptCheckpointError(
                f"pack chunk file has {size} bytes, expected {expected}", step=step, key=first.name, file=file
            )
        for info, dest, box in members:
            buf = memoryview(bytearray(info.nbytes))
            _pread_exact(fd, buf, info.packed_at(pack)[1])
            _place(buf, info, dest, box, step=step, file=file)
    finally:
        os.close(fd)


def _check_pack_chunk(
    data: memoryview, pack: ArrayInfo, index: tuple[int, ...], names: list[str], *, step: int | None, file: str
) -> None:
    """A pack chunk file's content against its crc32c trailer, and that against the manifest's digest of the chunk;
    the error names the pack (its key) and the packed tensors read from the chunk."""
    stored, digest = int.from_bytes(data[-4:], "little"), pack.digests[pack.ordinal(index)]
    if crc32c.crc32c(data[:-4]) != stored:
        problem = "pack chunk checksum (crc32c) mismatch"
    elif stored != digest:
        problem = f"pack chunk digest mismatch: the manifest expects crc32c {digest:08x}, the file holds {stored:08x}"
    else:
        return
    held = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise CorruptCheckpointError(
        f"{problem} in chunk {index[0]} of pack {pack.name!r}, which holds the packed tensors read ({held})",
        step=step,
        key=pack.name,
        file=file,
    )


def _place(
    data: memoryview, info: ArrayInfo, dest: torch.Tensor | None, box: Box | None, *, step: int | None, file: str
) -> None:
    """A packed tensor's bytes against the manifest's digest of them, then its `box` into `dest`."""
    crc = crc32c.crc32c(data)
    if info.digests is not None and crc != info.digests[0]:
        raise CorruptCheckpointError(
            f"packed tensor checksum (crc32c) mismatch: the manifest expects {info.digests[0]:08x}, its "
            f"{info.nbytes} bytes at offset {info.pack[1]} of the pack hold {crc:08x}",
            step=step,
            key=info.name,
            file=file,
        )
    if dest is None:
        return
    value = np.frombuffer(data, dtype=numpy_dtype(info.dtype)).reshape(info.shape)
    out = typed(as_bytes(dest), info.dtype, tuple(b - a for a, b in box))
    out[...] = value[tuple(slice(a, b) for a, b in box)]


def _open_chunk(path: str, info: ArrayInfo, step: int | None) -> int:
    """A chunk file's fd; a missing or special file is damage naming the key and the file."""
    try:
        return open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptCheckpointError("chunk file is missing", step=step, key=info.name, file=path) from None
    except UnsafeFileError as e:
        raise CorruptCheckpointError(f"chunk file is {e.strerror}", step=step, key=info.name, file=path) from None


def verify_array(
    storage: Storage,
    path: str,
    info: ArrayInfo,
    *,
    step: int | None,
    on_bytes: Callable[[int], None] | None = None,
    box: Sequence[tuple[int, int]] | None = None,
) -> None:
    """Check an array's zarr.json and every chunk (size, crc32c, digest), or the chunks of `box` only, one chunk in
    memory at a time."""
    check_zarr_json(storage, path, info, step=step)
    for index in info.chunks(tuple((0, n) for n in info.shape) if box is None else box):
        _read_chunk(storage, path, info, index, None, (), step)
        if on_bytes:
            on_bytes(info.itemsize * math.prod(min(c, n - i * c) for i, c, n in zip(index, info.chunk, info.shape)))
