"""The safetensors file format, written as a stream and read through mmap, without the `safetensors` package.

A file is: 8 bytes (little-endian u64) giving the header's length, the header (JSON, padded with spaces to a
multiple of 8: ``{"__metadata__": {str: str}, NAME: {"dtype", "shape", "data_offsets": [begin, end]}}``), then
the tensors' raw little-endian bytes, back to back, offsets relative to the end of the header. Knowing every
tensor's dtype and shape up front, a writer emits the header first and then each tensor's bytes as they come,
so an export never holds more than the piece it is writing.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping

import numpy as np
import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, dtype and shape (its bytes follow from them)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def number(x: int) -> str:
    """An int for a message: in full up to 24 digits, else its first digits and how many it has."""
    text = str(x)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text.lstrip('-'))} digits)"


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of a torch dtype; TypeError naming the key when the format has none."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"tensor {key!r} has dtype {str(dtype).removeprefix('torch.')}, which safetensors cannot "
            f"store (it stores {', '.join(sorted(str(d).removeprefix('torch.') for d in DTYPES))}); "
            f"export it with --format torch"
        ) from None


class Writer:
    """Writes one safetensors file as a stream: the header at once, then `write` each entry's bytes in order."""

    def __init__(self, path: str | os.PathLike, entries: list[Entry], metadata: Mapping[str, str]):
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for e in entries:
            header[e.name] = {
                "dtype": dtype_name(e.dtype, e.name),
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.path, self.size, self.written = os.fspath(path), offset, 0
        self._file = open(self.path, "xb")
        self._file.write(len(text).to_bytes(8, "little") + text)

    def write(self, data: memoryview | bytes | np.ndarray) -> None:
        """The next bytes of the tensors, in entry order."""
        n = memoryview(data).nbytes
        if self.written + n > self.size:
            raise ValueError(f"{self.path}: {self.written + n} bytes of tensor data, the header announced {self.size}")
        self._file.write(data)
        self.written += n

    def abandon(self) -> None:
        """Close without checking (the export failed; its temporary folder goes)."""
        self._file.close()

    def close(self) -> None:
        """Check every announced byte came, then make the file durable."""
        try:
            if self.written != self.size:
                raise ValueError(f"{self.path}: {self.written} bytes of tensor data, the header announced {self.size}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


def read_header(path: str | os.PathLike) -> tuple[dict[str, tuple[Entry, int]], dict[str, str], int]:
    """A file's tensors (entry, offset of its bytes in the file) in file order, its metadata and size; the header
    is validated (known dtypes, offsets inside the file that match each shape); ValueError naming the file."""
    path = os.fspath(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: safetensors header is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ must map str to str")
    entries, data = {}, 8 + n
    for name, d in header.items():
        if isinstance(d, dict) and isinstance(d.get("dtype"), str) and d["dtype"] not in _BY_NAME:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {d['dtype'][:20]}, which is not supported (supported: "
                f"{', '.join(sorted(_BY_NAME))})"
            )
        ok = (
            isinstance(d, dict)
            and d.get("dtype") in _BY_NAME
            and isinstance(d.get("shape"), list)
            and all(type(x) is int and x >= 0 for x in d["shape"])
            and math.prod(x for x in d["shape"] if x) < 1 << 62  # a zero-size tensor too: torch holds its shape
            and isinstance(d.get("data_offsets"), list)
            and len(d["data_offsets"]) == 2
            and all(type(x) is int for x in d["data_offsets"])
        )
        if not ok:
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {str(d)[:200]}")
        e = Entry(name, _BY_NAME[d["dtype"]], tuple(d["shape"]))
        a, b = d["data_offsets"]
        if not 0 <= a <= b <= size - data or b - a != e.nbytes:
            raise ValueError(
                f"{path}: tensor {name!r} has data_offsets [{number(a)}, {number(b)}], which do not hold its "
                f"{e.nbytes} bytes inside the file's {size - data} bytes of data"
            )
        entries[name] = (e, data + a)
    end = 0  # the spec's buffer: every byte of it indexed once, in order (no overlap, alias or hole)
    for name, (a, b) in sorted(
        ((k, (o - data, o - data + e.nbytes)) for k, (e, o) in entries.items()), key=lambda x: x[1]
    ):
        if a != end:
            raise ValueError(
                f"{path}: tensor {name!r} starts at data byte {a}, where {end} was expected: tensors overlap or "
                "leave a hole (safetensors indexes every byte once)"
            )
        end = b
    if end != size - data:
        raise ValueError(f"{path}: the tensors' data ends at byte {end} of the file's {size - data} bytes of data")
    return entries, metadata, size


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading; ValueError naming it unless it is a regular file (a FIFO would block the open
    until a writer came, a device read forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no wait for a FIFO's writer; no effect on a regular file
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "folder" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "device or socket"
        raise ValueError(f"{path} is a {kind}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique (json keeps the last of a repeated key, silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def open_tensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a file as a view of a copy-on-write mmap of it (pages come from the page cache as they
    are read, so a file larger than memory can be imported), and the file's metadata."""
    if sys.byteorder != "little":
        raise NotImplementedError("reading safetensors files needs a little-endian machine")
    entries, metadata, size = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="c", shape=(size,)) if size else np.zeros(0, np.uint8)
    raw = torch.from_numpy(mm)
    out = {}
    for name, (e, offset) in entries.items():
        piece = raw[offset : offset + e.nbytes]
        try:
            t = piece.view(e.dtype)
        except RuntimeError:  # not aligned for the dtype: this tensor alone is copied
            t = piece.clone().view(e.dtype)
        out[name] = t.reshape(e.shape)
    return out, metadata
