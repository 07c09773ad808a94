"""What is on disk: step directory names, the manifest schema and its validation, array names, chunk layout.

Layout of a root::

    step_00001200/manifest.json      written last; its presence is the commit
    step_00001200/arrays/<name>/     one zarr3 array per tensor (zarr.json + chunk files c/...)
    step_00001200/_IN_PROGRESS       marker of a save in flight (pid, host, time, lease); never read on restore
    _quarantine/step_00001200-<unix ms>/   a damaged step moved aside: its files and _DAMAGED (reason, time, host, pid)
    _LEASE, _GC_LOCK                 the writer's lease and gc's lock (see lease.py)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorstore as ts
import torch

from .errors import CorruptCheckpointError

FORMAT = "ckpt/1"
MANIFEST = "manifest.json"
IN_PROGRESS = "_IN_PROGRESS"
ARRAYS = "arrays"
QUARANTINE = "_quarantine"
DAMAGED = "_DAMAGED"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_QUARANTINED_RE = re.compile(r"^step_(\d{8,})-(\d+)$")
# An array name: '/'-separated segments of safe characters; no empty, '.' or '..' segment, nothing absolute.
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_%+=@,~-][A-Za-z0-9_.%+=@,~-]*$")
_MAX_SEGMENT = 200

# torch dtype <-> zarr3 data_type; the numpy dtype views the raw bytes for tensorstore.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.complex64: "complex64", torch.complex128: "complex128",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
    torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.bool: "bool",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, key: str = "?") -> str:
    """The on-disk name of a torch dtype; TypeError naming the key when it has none."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"tensor at key {key!r} has dtype {dtype}, which has no on-disk form "
                        f"(supported: {', '.join(sorted(_BY_NAME))})") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an on-disk dtype name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest") from None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype tensorstore uses for an on-disk dtype name (bfloat16, float8 via ml_dtypes)."""
    return np.dtype(ts.dtype(name).numpy_dtype)


def step_dir(step: int) -> str:
    """The directory name of a step; zero-padded so names sort by step."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_quarantined_dir(name: str) -> int | None:
    """The step a directory under ``_quarantine/`` holds (``step_XXXXXXXX-<unix ms>``), or None."""
    m = _QUARANTINED_RE.match(name)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=1 << 16)  # the same keys come back every save; this is on the stall path
def escape_segment(key: str | int) -> str:
    """A dict key as one path segment: percent-escapes anything unsafe, never '.', '..' or empty."""
    s = str(key)
    out = "".join(c if (c.isascii() and (c.isalnum() or c in "_.+=@,~-")) else "".join(f"%{b:02X}" for b in c.encode()) for c in s)
    if not out or out.startswith("."):
        out = "%2E" + out[1:] if out else "%00"
    if len(out) > _MAX_SEGMENT:
        out = out[:_MAX_SEGMENT - 17] + "~" + hashlib.sha256(out.encode()).hexdigest()[:16]
    return out


def validate_array_name(name: str) -> str:
    """Rejects array names from a manifest that could leave the step directory."""
    segments = name.split("/")
    if not name or any(not _SEGMENT_RE.match(s) or s in (".", "..") for s in segments):
        raise CorruptCheckpointError(f"manifest names an unsafe array path {name!r}", key=name)
    return name


@functools.lru_cache(maxsize=1 << 16)
def chunk_shape(shape: tuple[int, ...], itemsize: int, starts: tuple[tuple[int, ...], ...], target_bytes: int) -> tuple[int, ...]:
    """A regular chunk grid for a global array written as boxes starting at `starts`.

    Each box start must fall on a chunk boundary so that no two writers share a chunk; within that
    constraint the first splittable dimension is cut so that a chunk holds at most about `target_bytes`.
    A single writer gets an even split (little padding); otherwise the chunk divides every box start.
    """
    if not shape:
        return ()
    align = [0] * len(shape)
    for start in starts:
        for d, s in enumerate(start):
            align[d] = math.gcd(align[d], int(s))
    chunk = [max(1, a if a else n) for a, n in zip(align, shape)]
    for d in range(len(shape)):
        inner = itemsize * math.prod(chunk[d + 1:])
        if chunk[d] <= 1 or chunk[d] * inner <= target_bytes:
            continue
        max_rows = max(1, target_bytes // max(1, inner))
        if align[d]:
            chunk[d] = max(r for r in _divisors(chunk[d]) if r <= max_rows)
        else:
            pieces = math.ceil(chunk[d] / max_rows)
            chunk[d] = math.ceil(chunk[d] / pieces)
        break
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in small]


def zarr_metadata(dtype: str, shape: Sequence[int], chunk: Sequence[int]) -> dict[str, Any]:
    """zarr3 metadata of one array: raw little-endian bytes followed by a crc32c per chunk."""
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    }


@dataclass(frozen=True)
class ArrayInfo:
    """One global array of a checkpoint as the manifest records it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, int], ...], ...]  # written regions: per box, per dim (start, stop)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunk": list(self.chunk),
                "boxes": [[list(r) for r in box] for box in self.boxes]}

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> "ArrayInfo":
        try:
            info = cls(validate_array_name(name), str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                       tuple(int(x) for x in d["chunk"]),
                       tuple(tuple((int(a), int(b)) for a, b in box) for box in d["boxes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"malformed array entry in manifest: {e}", key=name) from None
        torch_dtype(info.dtype)
        if len(info.chunk) != len(info.shape) or any(s < 0 for s in info.shape) or any(c < 1 for c in info.chunk):
            raise CorruptCheckpointError(f"array shape {info.shape} / chunk {info.chunk} inconsistent", key=name)
        return info


@dataclass
class Manifest:
    """The committed description of one step: state tree, arrays, metadata, versions."""

    step: int
    tree: Any
    arrays: dict[str, ArrayInfo]
    metadata: dict[str, Any]
    time: float
    world_size: int = 1
    versions: dict[str, str] | None = None

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "step": self.step, "time": self.time, "world_size": self.world_size,
                "versions": self.versions or {}, "metadata": self.metadata, "tree": self.tree,
                "arrays": {k: v.to_json() for k, v in self.arrays.items()}}
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))  # key order is part of the state
        return json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body},
                          allow_nan=False, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, file: str) -> "Manifest":
        try:
            outer = json.loads(data)
            body = outer["body"]
            text = json.dumps(body, allow_nan=False, separators=(",", ":"))  # key order is part of the state
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {e}", file=file) from None
        if hashlib.sha256(text.encode()).hexdigest() != outer.get("sha256"):
            raise CorruptCheckpointError("manifest checksum mismatch", file=file)
        if body.get("format") != FORMAT:
            raise CorruptCheckpointError(f"unsupported format {body.get('format')!r}, expected {FORMAT!r}", file=file)
        arrays = {name: ArrayInfo.from_json(name, d) for name, d in body["arrays"].items()}
        return cls(step=int(body["step"]), tree=body["tree"], arrays=arrays, metadata=body["metadata"],
                   time=float(body["time"]), world_size=int(body["world_size"]), versions=body["versions"])
