"""Array IO through tensorstore, plus a verified direct-read fast path for local files.

Writes reference the staging arena without copying (`can_reference_source_data_indefinitely`): the
arena stays untouched until every write future of the save has resolved. Reads open arrays with
`fill_missing_data_reads=False` so a missing chunk is an error, never zeros. Local chunk files of
row-chunked arrays are read straight into the destination tensor with `preadv` and their crc32c checked.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import crc32c
import numpy as np
import tensorstore as ts
import torch

from .errors import CorruptCheckpointError
from .format import ArrayInfo, numpy_dtype, zarr_metadata


def _spec(kvstore: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": kvstore, **extra}


def create(kvstore: dict[str, Any], info: ArrayInfo, context: ts.Context) -> ts.Future:
    """Create (or open, when another rank created it) the zarr3 array described by `info`."""
    return ts.open(_spec(kvstore, metadata=zarr_metadata(info.dtype, info.shape, info.chunk),
                         create=True, open=True, store_data_equal_to_fill_value=True), context=context)


def write(array: ts.TensorStore, box: Iterable[tuple[int, int]], data: np.ndarray) -> ts.WriteFutures:
    """Write `data` (viewing staged bytes) into a box of the global array."""
    index = tuple(slice(a, b) for a, b in box)
    return array[index].write(data, can_reference_source_data_indefinitely=True)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's memory."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def typed(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """View raw staged bytes as the array's numpy dtype and shape."""
    return raw.view(numpy_dtype(dtype)).reshape(shape)


def read_into(kvstore: dict[str, Any], info: ArrayInfo, dest: torch.Tensor, box: tuple[tuple[int, int], ...],
              context: ts.Context, *, step: int | None, file_hint: str) -> None:
    """Read region `box` of an array into a contiguous CPU tensor, verifying every chunk's crc32c."""
    try:
        arr = ts.open(_spec(kvstore, open=True, fill_missing_data_reads=False), context=context,
                      read=True).result()
        if arr.shape != info.shape:
            raise CorruptCheckpointError(f"array has shape {arr.shape}, manifest says {info.shape}",
                                         step=step, key=info.name, file=file_hint)
        out = typed(as_bytes(dest), info.dtype, tuple(b - a for a, b in box))
        ts.array(out, copy=False, write=True, context=context).write(arr[tuple(slice(a, b) for a, b in box)]).result()
    except (ValueError, RuntimeError) as e:  # tensorstore reports DATA_LOSS / NOT_FOUND as ValueError
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"cannot read array: {e}", step=step, key=info.name, file=_chunk_of(e, file_hint)) from None


def _chunk_of(e: Exception, fallback: str) -> str:
    text = str(e)
    for marker in ('"c/', "c/"):
        i = text.find(marker)
        if i >= 0:
            tail = text[i + (1 if marker.startswith('"') else 0):]
            return os.path.join(fallback, tail.split('"')[0].split(" ")[0])
    return fallback


def direct_rows(info: ArrayInfo, box: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """The row range of `box` when it can be read straight from chunk files (whole rows, chunk-aligned).

    True of whole arrays and of the row shards of FSDP2, whose boundaries the writer put on chunk
    boundaries; other regions go through tensorstore.
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


def read_direct(array_dir: str, info: ArrayInfo, dest: torch.Tensor, rows: tuple[int, int], pool: ThreadPoolExecutor,
                *, step: int | None) -> list:
    """Submit reads of the chunk files of rows [a, b) straight into `dest`; each checks size and crc32c."""
    raw = as_bytes(dest)
    itemsize = numpy_dtype(info.dtype).itemsize
    row = itemsize * math.prod(info.shape[1:])
    per_chunk = info.chunk[0] if info.shape else 1
    n_rows = info.shape[0] if info.shape else 1
    a, b = rows
    futures = []
    for i in range(a // per_chunk, math.ceil(b / per_chunk)):
        first, last = i * per_chunk, min((i + 1) * per_chunk, n_rows)
        valid = memoryview(raw[(first - a) * row:(last - a) * row])
        pad = per_chunk * row - len(valid)
        key = "c" if not info.shape else "c/" + "/".join([str(i)] + ["0"] * (len(info.shape) - 1))
        futures.append(pool.submit(_read_chunk, os.path.join(array_dir, key), valid, pad, info.name, step))
    return futures


def _read_chunk(path: str, valid: memoryview, pad: int, key: str, step: int | None) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError("chunk file is missing", step=step, key=key, file=path) from None
    try:
        size = os.fstat(fd).st_size
        expected = len(valid) + pad + 4
        if size != expected:
            raise CorruptCheckpointError(f"chunk file has {size} bytes, expected {expected}", step=step, key=key, file=path)
        tail = bytearray(pad + 4)
        _pread_exact(fd, valid, 0)
        _pread_exact(fd, memoryview(tail), len(valid))
    finally:
        os.close(fd)
    crc = crc32c.crc32c(tail[:pad], crc32c.crc32c(valid)) if pad else crc32c.crc32c(valid)
    if crc != int.from_bytes(tail[pad:], "little"):
        raise CorruptCheckpointError("chunk checksum (crc32c) mismatch", step=step, key=key, file=path)


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + (1 << 30)]], offset + done)
        if n <= 0:
            raise OSError(f"short read at offset {offset + done}")
        done += n


def verify_array(kvstore: dict[str, Any], info: ArrayInfo, context: ts.Context, *, step: int | None,
                 file_hint: str, on_bytes: Callable[[int], None] | None = None) -> None:
    """Read every chunk of an array (checking each crc32c) in bounded slabs, discarding the data."""
    if math.prod(info.shape) == 0:
        return
    itemsize = numpy_dtype(info.dtype).itemsize
    row = itemsize * math.prod(info.shape[1:]) if info.shape else itemsize
    step_rows = max(info.chunk[0] if info.shape else 1, (256 << 20) // max(1, row))
    n_rows = info.shape[0] if info.shape else 1
    for a in range(0, n_rows, step_rows):
        b = min(n_rows, a + step_rows)
        box = ((a, b),) + tuple((0, n) for n in info.shape[1:]) if info.shape else ()
        buf = torch.empty((b - a) * row, dtype=torch.uint8)
        read_into(kvstore, info, buf, box, context, step=step, file_hint=file_hint)
        if on_bytes:
            on_bytes((b - a) * row)
