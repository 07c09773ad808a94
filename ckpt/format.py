"""What a step's files say: the manifest schema and its validation, dtypes, array names, chunk layout.

Where those files live in a root (step directories, the manifest, markers) is `layout.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .errors import CheckpointError, CorruptCheckpointError, described
from .paths import validate_array_name

if TYPE_CHECKING:
    import numpy as np
    import torch

FORMAT = "ckpt/5"  # ckpt/5: every box a rank writes is placed in its pack, a few large files (`ArrayInfo.places`)
# ckpt/4 (a save's arrays and packs in a directory of its own, `Manifest.data`), ckpt/3 (small tensors packed into one
# byte array per rank, `Manifest.packs`) and ckpt/2 (a crc32c digest per chunk in the manifest, one array per tensor)
# are still read; so is ckpt/1, whose chunks are checked by their own crc32c only. Older versions refuse ckpt/5 by
# its name instead of reading tensors from packs they would not know to look in.
_OLD_PACKS = ("ckpt/3", "ckpt/4")  # packs of small whole tensors, each in one chunk of a pack with crc32c trailers
_PACKED = (*_OLD_PACKS, FORMAT)  # formats that have packs
_DATA_DIR = ("ckpt/4", FORMAT)  # formats whose data live in a directory of the step's own
_READABLE = ("ckpt/1", "ckpt/2", *_PACKED)
# The directory of one save's data inside its step directory: a token drawn by the save (see `layout.data_dir`)
DATA_RE = re.compile(r"^w-[0-9a-f]{12}\Z")
PACK_BYTES = 1 << 62  # default `pack_bytes`: every box is placed in its writer's pack, whatever its size
PACK_FILES = 4  # a rank's pack is cut into at most this many files (chunks) of at most MAX_CHUNK_BYTES each
PACK_ALIGN_MIN = 1 << 20  # boxes of this size or more start at a multiple of 4096 in the pack (see `pack_layout`)
_PACK_ALIGN = 4096  # the arena's and O_DIRECT's alignment: such a box goes from the arena to disk without a copy
# An array name: '/'-separated segments of safe characters; no empty, '.' or '..' segment, nothing absolute.
_MAX_SEGMENT = 200
# An array name's length: an array of its own is the directory ``step_N/w-<token>/arrays/<name>/`` holding
# ``c/<i>/<j>...`` chunk files, and that whole path must fit a local path (PATH_MAX, 4096 bytes with the root's own)
# and an object key (1,024 bytes on S3 and GCS, with the root's prefix).
MAX_NAME = 400

# The zarr3 data_types a tensor may have; each is also the name of its torch dtype (torch.float64, ...). The numpy
# dtype views the raw bytes for tensorstore.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
# bytes per element of each on-disk dtype, as numpy_dtype(name).itemsize says (tests/test_cli_imports.py), without
# importing numpy or tensorstore: sizes are all a manifest's reader (the CLI) needs of its dtypes
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}  # fmt: skip


def dtype_itemsize(name: str) -> int:
    """Bytes per element of an on-disk dtype name."""
    size = _ITEMSIZE.get(name)
    return size if size is not None else numpy_dtype(name).itemsize


@functools.cache
def _torch_dtypes() -> dict[torch.dtype, str]:
    """torch dtype -> on-disk name; torch is imported on first use, so that reading a root's files (ettr's ledger,
    the CLI's listing) does not import it."""
    import torch

    return {getattr(torch, name): name for name in _DTYPE_NAMES}


def dtype_name(dtype: torch.dtype, *, key: str = "?") -> str:
    """The on-disk name of a torch dtype; TypeError naming the key when it has none."""
    try:
        return _torch_dtypes()[dtype]
    except KeyError:
        raise TypeError(
            f"tensor at key {key!r} has dtype {dtype}, which has no on-disk form "
            f"(supported: {', '.join(sorted(_DTYPE_NAMES))})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an on-disk dtype name."""
    if name not in _DTYPE_NAMES:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest")
    import torch

    return getattr(torch, name)


@functools.lru_cache(maxsize=None)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype tensorstore uses for an on-disk dtype name (bfloat16, float8 via ml_dtypes)."""
    import numpy as np  # here, not at the top: reading a manifest (the CLI) needs neither numpy nor tensorstore
    import tensorstore as ts

    return np.dtype(ts.dtype(name).numpy_dtype)


@functools.lru_cache(maxsize=1 << 16)  # the same keys come back every save; this is on the stall path
def escape_segment(key: str | int) -> str:
    """A dict key as one path segment: percent-escapes anything unsafe, never '.', '..' or empty. A lone surrogate
    (os.fsdecode's of a file name's non-UTF-8 bytes) escapes as its own 3 bytes, which no other character encodes to."""
    s = str(key)
    out = "".join(
        c
        if (c.isascii() and (c.isalnum() or c in "_.+=@,~-"))
        else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
        for c in s
    )
    if not out or out.startswith("."):
        out = "%2E" + out[1:] if out else "%00"
    if len(out) > _MAX_SEGMENT:
        out = out[: _MAX_SEGMENT - 17] + "~" + hashlib.sha256(out.encode()).hexdigest()[:16]
    return out


def sibling_segments(keys: Sequence[str | int]) -> list[str]:
    """The path segments of a dict's keys, one each (`escape_segment`), never two alike even ignoring case.

    Two keys may escape alike (the int 0 and the str "0"; "" and NUL; "W" and "w" on a case-insensitive file system,
    where they name one directory). An array under one would then lie inside, or be, the other's directory: a file
    where the other needs a directory (EISDIR), or two arrays' chunks in one file. Each key after the first of its
    kind takes ``~1``, ``~2``...: the first free among its siblings'. ASCII case is the only folding there is to
    fear: a segment is ASCII (`escape_segment` percent-escapes the rest).
    """
    segments = [escape_segment(k) for k in keys]
    folded = [s.lower() for s in segments]
    if len(set(folded)) == len(folded):  # every dict of a normal state: nothing to do
        return segments
    taken, seen = set(folded), set()
    for i, low in enumerate(folded):
        if low in seen:
            n = 1
            while f"{low}~{n}" in taken:
                n += 1
            segments[i], low = f"{segments[i]}~{n}", f"{low}~{n}"
            taken.add(low)
        seen.add(low)
    return segments


def array_name(segments: Sequence[str]) -> str:
    """The name of a tensor's array from its key path's segments: joined by '/', at most `MAX_NAME` characters.

    A longer path keeps its first characters and ends in ``~`` and 16 hex digits of its sha256, so every array's
    directory fits any root (a path of 25 keys of 200 characters failed the write with ENAMETOOLONG). The cut can
    fall anywhere: the segment it ends in still starts as it did (never '.'), or is the ``~`` tail alone. The tree
    refers to an array by this name, so a restore never derives it again and older steps read as they were written.
    """
    name = "/".join(segments) or "%00"
    if len(name) > MAX_NAME:
        name = name[: MAX_NAME - 17] + "~" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return name


@functools.lru_cache(maxsize=1 << 16)
def chunk_shape(
    shape: tuple[int, ...], itemsize: int, starts: tuple[tuple[int, ...], ...], target_bytes: int
) -> tuple[int, ...]:
    """A regular chunk grid for a global array written as boxes starting at `starts`.

    Each box start must fall on a chunk boundary so that no two writers share a chunk; within that
    constraint the first splittable dimension is cut so that a chunk holds at most about `target_bytes`.
    A single writer gets an even split (little padding); otherwise the chunk divides every box start.
    A chunk exceeds `target_bytes` only where a writer's box start forces it.
    """
    if not shape:
        return ()
    align = [0] * len(shape)
    for start in starts:
        for d, s in enumerate(start):
            align[d] = math.gcd(align[d], int(s))
    chunk = [max(1, a if a else n) for a, n in zip(align, shape)]
    for d in range(len(shape)):
        inner = itemsize * math.prod(chunk[d + 1 :])
        if chunk[d] <= 1 or chunk[d] * inner <= target_bytes:
            continue
        max_rows = max(1, target_bytes // max(1, inner))
        if align[d]:
            chunk[d] = max(r for r in _divisors(chunk[d]) if r <= max_rows)
        else:
            pieces = math.ceil(chunk[d] / max_rows)
            chunk[d] = math.ceil(chunk[d] / pieces)
        if chunk[d] * inner <= target_bytes:
            break  # else one row alone is too big: cut the next dimension too
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in small]


def zarr_metadata(dtype: str, shape: Sequence[int], chunk: Sequence[int], crc: bool = True) -> dict[str, Any]:
    """zarr3 metadata of one array: raw little-endian bytes followed by a crc32c per chunk (without `crc`: the raw
    bytes alone, as in a ckpt/5 pack, whose bytes the manifest's digest of each box placed in it covers).

    In the canonical form tensorstore writes (single-byte types carry no endianness), so that a
    `zarr.json` read back can be compared with it field by field.
    """
    raw = {"name": "bytes"} if dtype_itemsize(dtype) == 1 else {"name": "bytes", "configuration": {"endian": "little"}}
    return {
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [raw, {"name": "crc32c"}] if crc else [raw],
    }


_ZARR_INERT = {"zarr_format": 3, "node_type": "array", "fill_value": None, "attributes": None, "dimension_names": None}


def zarr_mismatch(data: bytes, info: "ArrayInfo") -> str | None:
    """How a stored `zarr.json` differs from what the manifest says the array is; None when it agrees.

    The manifest is authoritative: every field that decides how chunk bytes are laid out must be exactly
    the manifest's, and nothing else (no storage transformer, no other codec) may be there.
    """
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):
        return "is not JSON"
    if not isinstance(meta, dict):
        return "is not a JSON object"
    for k, v in zarr_metadata(info.dtype, info.shape, info.chunk, not info.raw).items():
        if meta.get(k) != v:
            return f"has {k} {json.dumps(meta.get(k))}, the manifest says {json.dumps(v)}"
    for k in meta:
        if k not in _ZARR_INERT and k not in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs"):
            return f"has an unexpected field {k!r}"
        if _ZARR_INERT.get(k) is not None and meta[k] != _ZARR_INERT[k]:
            return f"has {k} {json.dumps(meta[k])}, expected {json.dumps(_ZARR_INERT[k])}"
    return None


def chunk_key(index: Sequence[int]) -> str:
    """The file name of a chunk, relative to its array directory (zarr3 default key encoding)."""
    return "/".join(["c", *map(str, index)])


# Bounds a manifest must respect, checked before anything is allocated or opened.
MAX_RANK = 32  # dimensions of an array (tensorstore's limit)
MAX_CHUNK_BYTES = 1 << 32  # one chunk file; the manager refuses a larger chunk_bytes
MAX_CHUNKS = 1 << 24  # chunk files of one array
MAX_DEPTH = 100  # nesting of a state tree; deeper states are refused at save
_MAX_DIM = 1 << 62


@dataclass(frozen=True)
class ArrayInfo:
    """One global array of a checkpoint as the manifest records it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, int], ...], ...]  # written regions: per box, per dim (start, stop)
    # crc32c of each chunk file's content (the value zarr's crc32c codec appends), chunks in C order of
    # the chunk grid; None only in manifests of format ckpt/1, which had none. A placed array (`places`) has one per
    # segment of each box instead (`segments`), boxes in order: the crc32c of those bytes of the box in C order.
    digests: tuple[int, ...] | None = None
    # Placed (ckpt/5): box i's bytes (C order) are those at byte offset places[i][1] of the pack array named
    # places[i][0] (`Manifest.packs`), possibly across its chunks; chunk == shape. In ckpt/3-4 ("pack" in the
    # manifest) a small tensor of one box, never crossing a chunk of its pack. None: an array of its own.
    places: tuple[tuple[str, int], ...] | None = None
    # Placed: the bytes of a box checked by one digest (the last segment of a box may be shorter); the unit a read of
    # part of a box reads. 0: the whole box (ckpt/3-4).
    segment: int = 0
    # Chunk files without a crc32c trailer (the packs of ckpt/5: their bytes are checked by the placed boxes' digests)
    raw: bool = False

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk's content on disk (edge chunks are padded to the full chunk shape)."""
        return math.prod(self.chunk) * self.itemsize

    @property
    def file_nbytes(self) -> int:
        """Bytes of one chunk file: its content and, unless `raw`, the crc32c trailer."""
        return self.chunk_nbytes + (0 if self.raw else 4)

    def box_nbytes(self, box: Sequence[tuple[int, int]]) -> int:
        return math.prod(b - a for a, b in box) * self.itemsize

    @functools.cached_property
    def box_sizes(self) -> list[int]:
        """`box_nbytes` of each box, in order (a manifest of R ranks x T tensors has R x T boxes: each once)."""
        return [self.box_nbytes(box) for box in self.boxes]

    def segments(self, box: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """The segments of a placed box that hold its bytes [lo, hi): (first byte, end byte in the box, index of
        its digest)."""
        n = self.box_nbytes(self.boxes[box])
        size = self.segment or n
        first = self._digest_starts[box]
        hi = n if hi is None else hi
        return [(s, min(s + size, n), first + s // size) for s in range(lo // size * size, hi, size)]

    @property
    def digest_count(self) -> int:
        """Digests the manifest holds: one per chunk, or per segment of each box where placed."""
        return self._digest_starts[-1] if self.places is not None else math.prod(self.grid)

    @functools.cached_property
    def _digest_starts(self) -> list[int]:
        """The index of each placed box's first digest (`segments`), and their count last."""
        out = [0]
        for n in self.box_sizes:
            out.append(out[-1] + -(-n // (self.segment or n or 1)))
        return out

    @property
    def grid(self) -> tuple[int, ...]:
        """Chunks per dimension."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk))

    def chunks(self, box: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
        """Grid indices of the chunks that hold part of `box`, in C order."""
        return list(itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, self.chunk))))

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one index of the first dimension); a 0-d array is one row of one item."""
        return math.prod(self.shape[1:]) * self.itemsize

    def row_chunks(self, rows: tuple[int, int]) -> list[tuple[tuple[int, ...], int, int]]:
        """For an array chunked by whole rows (`store.direct_rows`): (grid index, first row, end row) of each chunk
        holding part of rows [a, b), the end cut at the array's last row; a 0-d array is one chunk of one row."""
        if not self.shape:
            return [((), 0, 1)]
        per_chunk, a, b = self.chunk[0], *rows
        pad = (0,) * (len(self.shape) - 1)
        return [
            ((i, *pad), i * per_chunk, min((i + 1) * per_chunk, self.shape[0]))
            for i in range(a // per_chunk, -(-b // per_chunk))
        ]

    def ordinal(self, index: Sequence[int]) -> int:
        """Position of a chunk in C order of the grid (its entry in `digests`)."""
        out = 0
        for i, n in zip(index, self.grid):
            out = out * n + i
        return out

    def to_json(self, format: str = FORMAT) -> dict[str, Any]:
        out = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk": list(self.chunk),
            "boxes": [[list(r) for r in box] for box in self.boxes],
            "digests": list(self.digests or ()),
        }
        if self.places is not None and format in _OLD_PACKS:
            out["pack"] = list(self.places[0])
        elif self.places is not None:
            out["places"] = [list(p) for p in self.places]
            out["segment"] = self.segment
        return out

    @classmethod
    def from_json(cls, name: str, d: Any, *, format: str = FORMAT, raw: bool = False) -> "ArrayInfo":
        """Validated: known dtype, bounded shape and chunk grid, boxes inside the shape, one digest per chunk (per
        box where placed; none where `raw`, a ckpt/5 pack); a place per box (its bounds in the pack are
        `pack_mismatch`'s, with the packs). Each message is made only for a failed check: a manifest holds one entry
        per tensor, and a restore reads them all."""
        validate_array_name(name)

        def need(ok: bool, what: Callable[[], str]) -> None:
            if not ok:
                raise CorruptCheckpointError(f"malformed array entry in manifest: {what()}", key=name)

        need(isinstance(d, dict), lambda: "not an object")
        dtype = d.get("dtype")
        need(isinstance(dtype, str) and dtype in _DTYPE_NAMES, lambda: f"unknown dtype {dtype!r}")
        shape, chunk = d.get("shape"), d.get("chunk")
        need(_ints(shape, 0, _MAX_DIM) and len(shape) <= MAX_RANK, lambda: f"bad shape {shape!r}")
        need(
            _ints(chunk, 1, _MAX_DIM)
            and len(chunk) == len(shape)
            and all(c <= max(n, 1) for c, n in zip(chunk, shape)),
            lambda: f"chunk {chunk!r} does not fit shape {shape}",
        )
        boxes = d.get("boxes")
        need(
            isinstance(boxes, list) and len(boxes) <= MAX_CHUNKS and _boxes_inside(boxes, shape),
            lambda: "boxes must be lists of [start, stop] inside the shape",
        )
        places = _places(d, format, need)
        segment = d.get("segment", 0) if places is not None and format == FORMAT else 0
        sums = d.get("digests")
        digests = None if format == "ckpt/1" else () if raw else tuple(sums) if isinstance(sums, list) else ()
        info = cls(
            name,
            dtype,
            tuple(shape),
            tuple(chunk),
            tuple(tuple((a, b) for a, b in box) for box in boxes),
            digests=digests,
            places=places,
            segment=segment if type(segment) is int else 0,
            raw=raw and format != "ckpt/1",
        )
        if places is not None:
            need(info.chunk == info.shape and info.nbytes > 0, lambda: "a placed array is one non-empty chunk")
            need(
                len(places) == len(info.boxes), lambda: f"needs a place per box ({len(info.boxes)}), has {len(places)}"
            )
            need(all(n > 0 for n in info.box_sizes), lambda: "a placed array's boxes are not empty")
            untiled = _untiled(info.shape, info.boxes)  # a read fills the tensor from its boxes alone
            need(untiled is None, lambda: f"its boxes do not tile its shape {list(info.shape)}: {untiled}")
            need(
                type(segment) is int and (segment >= 1 or format != FORMAT),
                lambda: f"bad segment {str(segment)[:50]!r}",
            )
            count = info.digest_count
            need(count <= MAX_CHUNKS, lambda: f"{count} segments, more than {MAX_CHUNKS}")
        else:
            need(
                info.chunk_nbytes <= MAX_CHUNK_BYTES,
                lambda: f"chunk of {info.chunk_nbytes} bytes, more than {MAX_CHUNK_BYTES}",
            )
            count = math.prod(info.grid)
            need(count <= MAX_CHUNKS, lambda: f"{count} chunks, more than {MAX_CHUNKS}")
        if format == "ckpt/1":
            return info
        if raw:
            need(sums == [] and places is None, lambda: "a pack of raw bytes has no digests of its own")
            return info
        unit = "segment" if places is not None else "chunk"
        need(
            _ints(sums, 0, (1 << 32) - 1) and len(sums) == count,
            lambda: f"needs {count} {unit} digests (crc32c values)",
        )
        return info


def _untiled(shape: tuple[int, ...], boxes: Sequence[Sequence[tuple[int, int]]]) -> str | None:
    """Why non-empty `boxes` inside `shape` do not tile it exactly (every element in exactly one box); None when
    they do. A 0-d array is tiled by exactly one box."""
    total, held = math.prod(shape), sum(math.prod(b - a for a, b in box) for box in boxes)
    if held != total:
        return f"they hold {held} of its {total} elements"
    both = overlapping(boxes)
    return None if both is None else f"boxes {both[0]} and {both[1]} overlap"


def overlapping(boxes: Sequence[Sequence[tuple[int, int]]]) -> tuple[int, int] | None:
    """The indices (lower first) of two non-empty boxes ([start, end) per dimension) that share an element, or None.
    Boxes are swept in order of their start along the dimension they are cut most along, each compared with those
    still open there: one for shards along one dimension, a row of the grid for grid shards."""
    if len(boxes) < 2 or not boxes[0]:
        return None
    k = max(range(len(boxes[0])), key=lambda d: len({box[d][0] for box in boxes}))
    open_: list[tuple[int, int]] = []  # (end along dimension k, box index): a heap
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][k][0]):
        box = boxes[i]
        while open_ and open_[0][0] <= box[k][0]:
            heapq.heappop(open_)
        for _, j in open_:
            if all(a < d and c < b for (a, b), (c, d) in zip(box, boxes[j])):
                return min(i, j), max(i, j)
        heapq.heappush(open_, (box[k][1], i))
    return None


def _places(
    d: dict[str, Any], format: str, need: Callable[[bool, Callable[[], str]], None]
) -> tuple[tuple[str, int], ...] | None:
    """An entry's places in packs: ckpt/5's "places" (one per box), ckpt/3-4's "pack" (its one box); None."""
    need(d.get("pack") is None or format in _OLD_PACKS, lambda: f"packed in format {format}")
    need(d.get("places") is None or format == FORMAT, lambda: f"placed in format {format}")
    if d.get("pack") is not None:
        raw = [d["pack"]]
    elif d.get("places") is not None:
        raw = d["places"]
        need(isinstance(raw, list), lambda: f"bad places {str(raw)[:100]!r}")
    else:
        return None
    for p in raw:
        ok = isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int
        need(ok and 0 <= p[1] <= _MAX_DIM, lambda: f"bad place {str(p)[:100]!r} (expected [pack name, byte offset])")
    for name in {p[0] for p in raw}:  # a pack's name once, not once per box placed in it
        try:
            validate_array_name(name)
        except CorruptCheckpointError as e:
            p, why = next(p for p in raw if p[0] == name), str(e)
            need(False, lambda: f"bad place {str(p)[:100]!r}: {why}")
    return tuple((p[0], p[1]) for p in raw)


def _span(info: ArrayInfo, i: int) -> str:
    at = info.places[i][1]
    return f"bytes [{at}, {at + info.box_nbytes(info.boxes[i])})"


def _boxes_inside(boxes: list[Any], shape: list[int]) -> bool:
    """Every box a list of one [start, stop] of ints per dimension, 0 <= start <= stop <= that dimension."""
    rank = len(shape)
    for box in boxes:
        if not (isinstance(box, list) and len(box) == rank):
            return False
        for r, n in zip(box, shape):
            if not (isinstance(r, list) and len(r) == 2):
                return False
            a, b = r
            if not (type(a) is int and type(b) is int and 0 <= a <= b <= n):
                return False
    return True


def _ints(v: Any, lo: int, hi: int) -> bool:
    """A list of ints (not bools) within [lo, hi]."""
    return isinstance(v, list) and all(type(x) is int and lo <= x <= hi for x in v)


def pack_layout(sizes: Sequence[int], chunk_bytes: int) -> tuple[list[int], int, int]:
    """Byte offsets of boxes of these sizes placed back to back in one rank's pack, and the pack's chunk (file) size:
    (offsets, total bytes, chunk bytes).

    Boxes of at least PACK_ALIGN_MIN bytes start on a multiple of 4096, as they start in the staging arena, so
    that their bytes go to an O_DIRECT file without a copy; the rest follow each other, crossing chunks freely.
    The pack is cut into as few chunks of at least `chunk_bytes` as it takes, at most PACK_FILES (more only where
    a chunk would exceed MAX_CHUNK_BYTES), of equal size: the last is padded to it, by less than 4096 bytes a chunk.
    """
    offsets, at = [], 0
    for n in sizes:
        if n >= PACK_ALIGN_MIN:
            at = -(-at // _PACK_ALIGN) * _PACK_ALIGN
        offsets.append(at)
        at += n
    total = max(at, 1)
    files = max(min(PACK_FILES, -(-total // chunk_bytes)), -(-total // MAX_CHUNK_BYTES))
    chunk = -(-total // files)
    if files > 1 and chunk >= _PACK_ALIGN:
        chunk = min(-(-chunk // _PACK_ALIGN) * _PACK_ALIGN, MAX_CHUNK_BYTES)
    return offsets, at, chunk


def pack_mismatch(info: ArrayInfo, packs: dict[str, ArrayInfo], format: str) -> str | None:
    """Why a placed box's place in its pack is impossible (no such pack, out of it, across a chunk where the format
    does not allow it, a pack of the other kind); else None."""
    for (pack_name, offset), n in zip(info.places, info.box_sizes):
        pack = packs.get(pack_name)
        if pack is None:
            return f"names pack {pack_name!r}, which the manifest does not list"
        if offset + n > pack.shape[0]:
            return f"bytes [{offset}, {offset + n}) do not lie in pack {pack.name!r} {list(pack.shape)}"
        if format in _OLD_PACKS and offset // pack.chunk[0] != (offset + n - 1) // pack.chunk[0]:
            return f"bytes [{offset}, {offset + n}) do not lie in one chunk of pack {pack.name!r} {list(pack.shape)}"
    return None


def pack_overlap(arrays: dict[str, ArrayInfo]) -> tuple[str, tuple[str, int], tuple[str, int]] | None:
    """Two placed boxes that share a byte of their pack: (pack, (key, box index) of one, of the other); None when
    none do. A writer lays them out apart (`pack_layout`), so any overlap is a crafted or damaged manifest."""
    by_pack: dict[str, list[tuple[int, int, str, int]]] = {}
    for name, info in arrays.items():
        for i, ((pack, at), n) in enumerate(zip(info.places or (), info.box_sizes)):
            by_pack.setdefault(pack, []).append((at, at + n, name, i))
    for pack, members in by_pack.items():
        members.sort()
        end, last = 0, ("", 0)
        for a, b, name, i in members:
            if a < end:
                return pack, last, (name, i)
            if b > end:
                end, last = b, (name, i)
    return None


_TAGS = ({"$float"}, {"$dict"})  # the keys of `_floats_out`'s own dicts


def deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests dicts and lists more than `limit` levels (no recursion: any depth is safe)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return False


def _floats_out(value: Any) -> Any:
    """User metadata for the manifest: a NaN or infinite float (a diverged loss) as ``{"$float": "nan"}``, as
    the state tree writes it (the manifest is strict JSON); a user's dict that looks like one of these
    (``{"$float": "inf"}``) is wrapped as ``{"$dict": ...}``, so it reads back as the dict it was."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if isinstance(value, dict):
        out = {k: _floats_out(v) for k, v in value.items()}
        return {"$dict": out} if value.keys() in _TAGS else out
    if isinstance(value, list):
        return [_floats_out(v) for v in value]
    return value


def _floats_in(value: Any) -> Any:
    """The inverse of `_floats_out`."""
    if isinstance(value, dict):
        if value.keys() == {"$float"} and value["$float"] in ("nan", "inf", "-inf"):
            return float(value["$float"])
        if value.keys() == {"$dict"} and isinstance(value["$dict"], dict):
            return {k: _floats_in(v) for k, v in value["$dict"].items()}
        return {k: _floats_in(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats_in(v) for v in value]
    return value


@dataclass
class Manifest:
    """The committed description of one step: state tree, arrays, metadata, versions."""

    step: int
    tree: dict[str, Any]
    arrays: dict[str, ArrayInfo]
    metadata: dict[str, Any]
    time: float
    world_size: int = 1
    versions: dict[str, str] | None = None
    format: str = FORMAT  # as read; a manifest this version writes is always FORMAT
    # ckpt/3: the byte arrays (uint8, 1-D) holding packed tensors, one per rank that packed any, by name
    packs: dict[str, ArrayInfo] = dataclasses.field(default_factory=dict)
    # ckpt/4: the directory of the step holding this save's arrays and packs ("": the step directory itself, as
    # before ckpt/4); each save writes into one of its own, so a writer that lost the root's lease never touches
    # the files of the step its successor commits
    data: str = ""
    # a rank's own root (a local tier, or a peer's replica of one) holds one box of some arrays, not the step: the
    # index of the box it holds of each array it holds (None: a shared root, which holds every box); written as a
    # list in the arrays' order, -1 for none (older readers ignore it)
    held: dict[str, int] | None = None

    def boxes_here(self, name: str) -> list[int]:
        """The indices of the boxes of array `name` that this manifest's root holds (every box of a shared root)."""
        if self.held is None:
            return list(range(len(self.arrays[name].boxes)))
        return [self.held[name]] if name in self.held else []

    def nbytes_here(self) -> int:
        """The bytes of tensors this manifest's root holds (what `ckpt verify` checks)."""
        return sum(a.box_nbytes(a.boxes[i]) for name, a in self.arrays.items() for i in self.boxes_here(name))

    def to_json(self) -> dict[str, Any]:
        """The manifest's body: what `to_bytes` checksums and writes (and `ckpt inspect --json` prints)."""
        return {
            "format": self.format,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "versions": self.versions or {},
            "metadata": _floats_out(self.metadata),
            "tree": self.tree,
            "arrays": {k: v.to_json(self.format) for k, v in self.arrays.items()},
            **({"packs": {k: v.to_json(self.format) for k, v in self.packs.items()}} if self.format in _PACKED else {}),
            **({"data": self.data} if self.format in _DATA_DIR else {}),
            **({"held": [self.held.get(k, -1) for k in self.arrays]} if self.held is not None else {}),
        }

    def to_bytes(self) -> bytes:
        body = self.to_json()
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))  # key order is part of the state
        return json.dumps(
            {"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}, allow_nan=False, separators=(",", ":")
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, file: str) -> "Manifest":
        """Checksum, format and the schema of every field except the tree (see `state.check_tree`)."""
        try:
            outer = json.loads(data)
            body = outer["body"]
            text = json.dumps(body, allow_nan=False, separators=(",", ":"))  # key order is part of the state
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {described(e)}", file=file) from None
        if hashlib.sha256(text.encode()).hexdigest() != outer.get("sha256"):
            raise CorruptCheckpointError("manifest checksum mismatch", file=file)
        if not isinstance(body, dict):
            raise CorruptCheckpointError("manifest body is not an object", file=file)
        if body.get("format") not in _READABLE:
            raise CheckpointError(
                f"{file} has format {body.get('format')!r}, which this version of ckpt does not "
                f"read (it reads {', '.join(_READABLE)}): was it written by a newer version?"
            )
        fields = {
            "step": lambda v: type(v) is int and v >= 0,
            "time": lambda v: type(v) in (int, float) and -(2**53) <= v <= 2**53,  # no NaN, inf or 10**400
            "world_size": lambda v: type(v) is int and 1 <= v <= MAX_CHUNKS,
            "versions": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
            # saved at most MAX_DEPTH deep, each level perhaps wrapped ({"$dict": ...}), a {"$float"} at the bottom
            "metadata": lambda v: isinstance(v, dict) and not deeper_than(v, 2 * MAX_DEPTH + 1),
            "tree": lambda v: isinstance(v, dict),
            "arrays": lambda v: isinstance(v, dict),
        }
        for k, ok in fields.items():
            if not ok(body.get(k)):
                raise CorruptCheckpointError(f"malformed manifest: bad {k} {str(body.get(k))[:100]!r}", file=file)
        packs_json = body.get("packs", {}) if body["format"] in _PACKED else {}
        if not isinstance(packs_json, dict):
            raise CorruptCheckpointError("malformed manifest: bad packs", file=file)
        data = body.get("data") if body["format"] in _DATA_DIR else ""
        if data != "" and not (isinstance(data, str) and DATA_RE.match(data)):
            raise CorruptCheckpointError(f"malformed manifest: bad data directory {str(data)[:100]!r}", file=file)
        fmt = body["format"]
        try:
            arrays = {name: ArrayInfo.from_json(name, d, format=fmt) for name, d in body["arrays"].items()}
            # ckpt/5 packs are raw bytes: the digests of the boxes placed in them cover them
            packs = {
                name: ArrayInfo.from_json(name, d, format=fmt, raw=fmt == FORMAT) for name, d in packs_json.items()
            }
            for name, info in packs.items():
                if info.dtype != "uint8" or len(info.shape) != 1 or info.places is not None or not info.shape[0]:
                    raise CorruptCheckpointError("malformed pack entry in manifest: not a 1-D uint8 array", key=name)
            for name, info in arrays.items():
                mismatch = info.places is not None and pack_mismatch(info, packs, fmt)
                if mismatch:
                    raise CorruptCheckpointError(f"malformed array entry in manifest: {mismatch}", key=name)
            overlap = pack_overlap(arrays)
            if overlap:
                pack, (a, i), (b, j) = overlap
                raise CorruptCheckpointError(
                    f"malformed manifest: placed tensors {a!r} (box {i}) and {b!r} (box {j}) overlap in pack "
                    f"{pack!r} ({_span(arrays[a], i)} and {_span(arrays[b], j)})",
                    key=b,
                )
            held = _held(body.get("held"), arrays)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(e.message, step=e.step, key=e.key, file=file) from None
        return cls(
            step=body["step"],
            tree=body["tree"],
            arrays=arrays,
            metadata=_floats_in(body["metadata"]),
            time=float(body["time"]),
            world_size=body["world_size"],
            versions=body["versions"],
            format=body["format"],
            packs=packs,
            data=data,
            held=held,
        )


def _held(value: Any, arrays: dict[str, ArrayInfo]) -> dict[str, int] | None:
    """A manifest's ``held`` (a rank's own root: the box it holds of each array, -1 for none), checked against the
    arrays."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != len(arrays):
        raise CorruptCheckpointError(f"malformed manifest: bad held {str(value)[:100]!r} ({len(arrays)} arrays)")
    held = {}
    for (name, info), box in zip(arrays.items(), value):
        if type(box) is not int or not -1 <= box < len(info.boxes):
            raise CorruptCheckpointError(
                f"malformed manifest: held box {str(box)[:100]!r} of an array of {len(info.boxes)} boxes", key=name
            )
        if box >= 0:
            held[name] = box
    return held
