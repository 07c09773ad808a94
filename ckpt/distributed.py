"""Ranks: who writes which slice of each global array, the single commit, and what a rank reads back.

Every collective runs on a dedicated gloo group (created with the manager, with a timeout), never on
the training group, so background saves do not interleave with training collectives (NCCL or gloo)
and a dead rank turns into an error after the timeout instead of a hang.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import zlib
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import StateMismatchError
from .format import ArrayInfo, chunk_shape, dtype_name, pack_layout, torch_dtype
from .layout import pack_name
from .state import is_dtensor

Box = tuple[tuple[int, int], ...]


def topology() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's when initialized, else (0, 1). The one place ckpt
    asks; ettr reads the launcher's variables itself, so that it stands without ckpt."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Ranks:
    """This process's place among the ranks and the collectives of checkpointing; alone (`local`) they are trivial."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    @classmethod
    def local(cls) -> "Ranks":
        """A process alone: world size 1, a gather returns its own value, a barrier returns at once."""
        return cls()

    @staticmethod
    def current(timeout: timedelta) -> "Ranks":
        """The ranks of torch.distributed when it is initialized (with a gloo group of their own), else `local()`."""
        return GlooRanks(timeout) if dist.is_available() and dist.is_initialized() else Ranks.local()

    @property
    def leader(self) -> bool:
        """Rank 0: it holds the root's lease, commits, retains and quarantines for all."""
        return self.rank == 0

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON value, in rank order."""
        return [obj]

    def barrier(self) -> None:
        """Wait until every rank is here."""


class GlooRanks(Ranks):
    """The ranks of torch.distributed, through a gloo group of their own (created once, with a timeout)."""

    def __init__(self, timeout: timedelta):
        super().__init__(*topology())
        self.group = dist.new_group(backend="gloo", timeout=timeout)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON value, in rank order (bytes over gloo, no pickle)."""
        data = torch.frombuffer(bytearray(json.dumps(obj, allow_nan=False).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(bytes(o[: int(s.item())].tolist())) for o, s in zip(out, sizes)]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The local data of a (D)Tensor and the box of the global array it covers."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple((o, o + s) for o, s in zip(offset, shape))
    return t, _whole(tuple(t.shape))


@functools.lru_cache(maxsize=1 << 16)  # the same shapes come back every save; this is on the stall path
def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def plan_arrays(
    ranks: Ranks,
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
    pack_bytes: int = 0,
    *,
    every_holder: bool = False,
) -> tuple[dict[str, ArrayInfo], dict[str, torch.Tensor], dict[str, Box], frozenset[str], dict[str, ArrayInfo]]:
    """Agree with every rank on the global arrays; returns (arrays, what this rank writes, its boxes, the names
    of the arrays whose box this rank is the designated writer of, packs).

    A box held by several ranks (replicated tensors, DTensor Replicate) has one designated writer, chosen by a
    hash of the array name so that the writing is spread over the ranks. A shared root gets only the designated
    writes; with `every_holder` (a root of this rank's own: the local tier) each rank writes every box it holds.
    A tensor its writer writes whole, of at most `pack_bytes` (and `chunk_bytes`), goes into that rank's pack
    (`format.pack_layout`): every rank computes every rank's packs alike from what they agreed, so nothing more is
    exchanged. A rank's own root (`every_holder`) is not packed: it holds boxes that other ranks' packs would hold,
    and a persist copies its files as they are into the shared layout.
    """
    mine = {name: local_box(t) for name, t in tensors.items()}
    described = {name: (dtype_name(t.dtype, key=name), tuple(t.shape), mine[name][1]) for name, t in tensors.items()}
    held: dict[str, tuple[str, tuple[int, ...], dict[Box, list[int]]]] = {}  # name -> dtype, shape, box -> ranks
    for rank, arrays in enumerate(ranks.all_gather_json(described)):
        for name, (dt, shape, box) in arrays.items():
            if type(box) is not tuple:  # lists, through JSON among ranks
                shape, box = tuple(shape), tuple(map(tuple, box))
            entry = held.setdefault(name, (dt, shape, {}))
            if entry[0] != dt or entry[1] != shape:
                raise ValueError(f"ranks disagree on tensor {name!r}: {entry[:2]} vs {(dt, shape)} on rank {rank}")
            entry[2].setdefault(box, []).append(rank)
    arrays, writes, boxes, designated = {}, {}, {}, set()
    packed: dict[int, list[str]] = {}  # writer rank -> the arrays it packs, in the agreed order
    limit = 0 if every_holder else min(pack_bytes, chunk_bytes)
    for name, (dt, shape, by_box) in held.items():
        ordered = tuple(sorted(by_box))
        if sum(map(_volume, ordered)) != math.prod(shape):
            raise ValueError(
                f"the ranks' pieces of tensor {name!r} do not tile its global shape {list(shape)} "
                f"(boxes {list(ordered)}); is it a plain tensor that differs across ranks?"
            )
        chunk = chunk_shape(shape, torch_dtype(dt).itemsize, _starts(ordered), chunk_bytes)
        arrays[name] = ArrayInfo(name, dt, shape, chunk, ordered)
        for box, rks in by_box.items():
            writer = rks[0] if len(rks) == 1 else rks[zlib.crc32(name.encode()) % len(rks)]
            if writer == ranks.rank:
                designated.add(name)
            if writer == ranks.rank or (every_holder and ranks.rank in rks):
                writes[name], boxes[name] = mine[name][0], box
            if len(ordered) == 1 and 0 < arrays[name].nbytes <= limit:
                packed.setdefault(writer, []).append(name)
    packs = {}
    for writer, names in sorted(packed.items()):
        pack = pack_name(writer)
        offsets, total, chunk = pack_layout([arrays[n].nbytes for n in names], chunk_bytes)
        packs[pack] = ArrayInfo(pack, "uint8", (total,), (chunk,), (((0, total),),))
        for n, offset in zip(names, offsets):
            arrays[n] = dataclasses.replace(arrays[n], chunk=arrays[n].shape, pack=(pack, offset))
    return arrays, writes, boxes, frozenset(designated), packs


@functools.lru_cache(maxsize=1 << 16)
def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@functools.lru_cache(maxsize=1 << 16)
def _starts(boxes: tuple[Box, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(a for a, _ in box) for box in boxes)


def read_region(info: ArrayInfo, template: Any) -> tuple[Any, Box] | None:
    """For a DTensor target, the local shard and the box of the global array it holds; else None (read whole)."""
    if not is_dtensor(template):
        return None
    if tuple(template.shape) != info.shape:
        raise StateMismatchError(
            f"restore of key {info.name!r}: checkpoint has global shape {list(info.shape)}, "
            f"the target DTensor has {list(template.shape)}"
        )
    return template, local_box(template)[1]


def prepare_optimizers(state: Mapping[str, Any], keys: Any) -> None:
    """Give optimizers of sharded (DTensor) parameters their state tensors, so a restore can fill them in place."""
    for k, v in state.items():
        if (
            (keys is None or k in keys)
            and isinstance(v, torch.optim.Optimizer)
            and not v.state
            and any(is_dtensor(p) for g in v.param_groups for p in g["params"])
        ):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(v)
