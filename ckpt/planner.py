"""Which rank writes which box of which global array: agreed once among ranks, reused while the state keeps its shape.

Planning a save among N ranks needs every rank's description of its tensors (name, dtype, global shape, box). The
leader alone gathers them, computes the arrays and each rank's writes, and sends each rank only its own part, so
neither the bytes nor the work of a rank grow with N times the tensors (a rank's own root, the local tier, is the
exception: each rank commits a manifest of every array there, so every rank gathers every description). In its own
root a rank places every box it holds in its own pack; its plan also carries the shared root's (`durable`), which a
persist lays the rank's designated boxes out by. While
every rank's description hashes as at the last agreement, the plan is reused: a save then costs one all-reduce of a
flag, whatever the world size and the tensor count.

A restore is planned alike (`share_reads`): a region of an array that several ranks restore (a replicated
tensor, a DTensor's Replicate dimension) is read from the root by one of its holders and sent to the others, so that
a root is read once whatever the replicas; a large region is cut into bands (where no byte is read twice: at its
digests' boundaries), and the regions and bands are spread so that each holder reads about as many bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .distributed import Box, Ranks, local_box
from .errors import CheckpointWriteError
from .format import ArrayInfo, chunk_shape, dtype_name, pack_layout, torch_dtype
from .layout import pack_name

Description = dict[str, tuple[str, tuple[int, ...], Box]]  # name -> dtype, global shape, the box this rank holds


@dataclass(frozen=True)
class ArrayPlan:
    """A rank's part of a save's plan.

    `arrays`: every array on the leader (it writes the manifest) and on every rank of a private root; elsewhere the
    arrays this rank writes. `written`: the arrays whose box this rank writes; `designated`: those it is the one
    writer of in a shared root; `packs`: the pack arrays this rank knows, as `arrays`.
    """

    arrays: dict[str, ArrayInfo]
    written: frozenset[str]
    designated: frozenset[str]
    packs: dict[str, ArrayInfo]
    durable: "ArrayPlan | None" = None  # of a private root: this rank's part of the shared root's plan (a persist's)
    held: Mapping[str, int] | None = None  # of a private root: the index of the box it holds of each array it holds


class Planner:
    """Plans a save's arrays among ranks, reusing the last plan while no rank's tensors changed their structure."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._plan: ArrayPlan | None = None
        self.agreements = 0  # saves planned from every rank's descriptions (the others reused the plan)

    def plan(
        self,
        ranks: Ranks,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        pack_bytes: int = 0,
        *,
        every_holder: bool = False,
        step: int = 0,
        failure: str | None = None,
        persist: bool | None = None,
        skeleton: list[str] | None = None,
    ) -> tuple[ArrayPlan, dict[str, torch.Tensor], dict[str, Box]]:
        """(this rank's part of the plan, the local tensors it writes by array, the box of each).

        The save's first message among the ranks carries each rank's `step` (and `persist`, and a hash of its state's
        `skeleton`, `tree.skeleton`) and, where this rank cannot save, `failure` (why; `tensors` may then be empty):
        when any rank failed, or the ranks' steps or skeletons differ, every rank raises `CheckpointWriteError`, so
        no rank pairs up the messages of one save with another's and none commits a tree that lacks another's keys.

        A box held by several ranks (replicated tensors, DTensor Replicate) has one designated writer, chosen by a
        hash of the array name so that the writing is spread over the ranks. A shared root gets only the designated
        writes; with `every_holder` (a root of this rank's own: the local tier) each rank writes every box it holds.
        Every box of an array whose boxes are all of at most `pack_bytes` (0: none) is placed in its
        writer's pack, a few large files per rank (`format.pack_layout`); other arrays are chunked arrays of their
        own. In a rank's own root its pack holds every box it holds, replicas included (`_own_root`).
        """
        mine = {name: local_box(t) for name, t in tensors.items()}
        described = {
            name: (dtype_name(t.dtype, key=name), tuple(t.shape), mine[name][1]) for name, t in tensors.items()
        }
        params = [chunk_bytes, pack_bytes, every_holder, ranks.world_size, ranks.rank]
        key = hashlib.blake2b(json.dumps([params, described]).encode(), digest_size=16).hexdigest()
        # a key may hold a lone surrogate (os.fsdecode's of non-UTF-8 bytes), which plain UTF-8 cannot encode
        text = None if skeleton is None else "\n".join(skeleton).encode("utf-8", "surrogatepass")
        shape = None if text is None else hashlib.blake2b(text, digest_size=16).hexdigest()
        told = ranks.all_gather_json([[step, persist, shape], failure, failure is None and key == self._key])
        _check_opening(step, told)
        if len({opening[2] for opening, _, _ in told}) > 1:  # every rank sees it: each takes part in naming the keys
            raise CheckpointWriteError(step, RuntimeError(_unshared(ranks.all_gather_json(skeleton))))
        if not all(same for _, _, same in told):
            self._key = None  # an agreement that fails on some rank leaves no plan behind on any
            self._plan = _agree(ranks, described, chunk_bytes, pack_bytes, every_holder)
            self._key, self.agreements = key, self.agreements + 1
        plan = self._plan
        assert plan is not None
        return plan, {n: mine[n][0] for n in plan.written}, {n: mine[n][1] for n in plan.written}


def _check_opening(step: int, told: list[Any]) -> None:
    """Raise on every rank when some rank cannot save `step`, or saves another step or with another `persist=`
    (`told`: each rank's [step, persist], failure and plan flag, in rank order)."""
    failures = [f"rank {r}: {failure}" for r, (_, failure, _) in enumerate(told) if failure]
    if failures:
        raise CheckpointWriteError(step, RuntimeError("; ".join(failures)))
    for i, what, advice in (
        (0, "steps", "every rank must save the same step in the same order (did a rank skip a save, or go on after "
         "a save that raised on it alone?)"),
        (1, "persist=", "give every rank the same"),
    ):  # fmt: skip
        values = [opening[i] for opening, _, _ in told]
        if len(set(values)) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise CheckpointWriteError(
                step, RuntimeError(f"the ranks called save with different {what} ({each}): {advice}")
            )


def _unshared(skeletons: list[list[str]]) -> str:
    """What differs between the ranks' skeletons, against rank 0's: a few paths each rank has alone, or lacks."""
    first = set(skeletons[0])
    diffs = []
    for r, skeleton in enumerate(skeletons[1:], 1):
        extra, missing = sorted(set(skeleton) - first), sorted(first - set(skeleton))
        for what, lines in (("has", extra), ("lacks", missing)):
            if lines:
                more = f" and {len(lines) - 3} more" if len(lines) > 3 else ""
                diffs.append(f"rank {r} {what} {', '.join(repr(line) for line in lines[:3])}{more}")
    return (
        f"the ranks' states differ in their keys (against rank 0's: {'; '.join(diffs)}). Every rank saves the same "
        "keys (and the same state of an object with same_on_every_rank = True: a data sampler), and rank 0's tree is "
        "the one committed; state that differs per rank goes in a top-level entry whose object has per_rank = True"
    )


def _agree(ranks: Ranks, described: Description, chunk_bytes: int, pack_bytes: int, every_holder: bool) -> ArrayPlan:
    """Every rank's descriptions to the leader (to every rank with `every_holder`), and each rank its part back."""
    if every_holder:
        gathered = ranks.all_gather_json(described)
        shared = _global(gathered, chunk_bytes, pack_bytes, ranks.rank)[ranks.rank]
        return _own_root(shared, gathered[ranks.rank], ranks.rank, chunk_bytes)
    gathered = ranks.gather_json(described)
    plans, refused, parts = None, None, None
    if gathered is not None:
        try:
            plans = _global(gathered, chunk_bytes, pack_bytes)
            parts = [_to_json(plans[r]) for r in range(ranks.world_size)]
        except ValueError as e:  # the ranks' tensors do not fit together: every rank learns it, none waits
            refused, parts = e, [{"refused": str(e)}] * ranks.world_size
    part = ranks.scatter_json(parts)
    if refused is not None:
        raise refused
    if "refused" in part:
        raise ValueError(f"rank 0 could not plan the save: {part['refused']}")
    return plans[ranks.rank] if plans is not None else _from_json(part)


def _global(gathered: list[Any], chunk_bytes: int, pack_bytes: int, only: int | None = None) -> dict[int, ArrayPlan]:
    """Every rank's plan of a shared root from every rank's descriptions (JSON: boxes as lists); `only`: that
    rank's alone."""
    held: dict[str, tuple[str, tuple[int, ...], dict[Box, list[int]]]] = {}  # name -> dtype, shape, box -> ranks
    for rank, arrays in enumerate(gathered):
        for name, (dt, shape, box) in arrays.items():
            if type(box) is not tuple:  # lists, through JSON among ranks
                shape, box = tuple(shape), tuple(map(tuple, box))
            entry = held.setdefault(name, (dt, shape, {}))
            if entry[0] != dt or entry[1] != shape:
                raise ValueError(f"ranks disagree on tensor {name!r}: {entry[:2]} vs {(dt, shape)} on rank {rank}")
            entry[2].setdefault(box, []).append(rank)
    world = range(len(gathered)) if only is None else [only]
    arrays: dict[str, ArrayInfo] = {}
    written: dict[int, set[str]] = {r: set() for r in world}
    designated: dict[int, set[str]] = {r: set() for r in world}
    placed: dict[int, list[tuple[str, int]]] = {}  # writer rank -> (array, box index) it places, in agreed order
    for name, (dt, shape, by_box) in held.items():
        ordered = tuple(sorted(by_box))
        if sum(map(_volume, ordered)) != math.prod(shape):
            raise ValueError(
                f"the ranks' pieces of tensor {name!r} do not tile its global shape {list(shape)} "
                f"(boxes {list(ordered)}); is it a plain tensor that differs across ranks?"
            )
        itemsize = torch_dtype(dt).itemsize
        full = tuple(b for b in ordered if _volume(b))
        place = bool(full) and all(_volume(b) * itemsize <= pack_bytes for b in full)
        if place:  # one "chunk", the array; its non-empty boxes each at a place in their writer's pack, checked by
            # a digest per `chunk_bytes` of each (a read of part of a box reads the segments that hold it)
            arrays[name] = ArrayInfo(name, dt, shape, shape, full, segment=chunk_bytes)
        else:
            chunk = chunk_shape(shape, itemsize, _starts(ordered), chunk_bytes)
            arrays[name] = ArrayInfo(name, dt, shape, chunk, ordered)
        for box, rks in by_box.items():
            writer = rks[0] if len(rks) == 1 else rks[zlib.crc32(name.encode()) % len(rks)]
            if writer in designated:
                designated[writer].add(name)
            if writer in written:
                written[writer].add(name)
            if place and _volume(box):
                placed.setdefault(writer, []).append((name, full.index(box)))
    packs = {}
    places: dict[str, list[tuple[str, int]]] = {n: [("", 0)] * len(a.boxes) for n, a in arrays.items()}
    for writer, boxes in sorted(placed.items()):
        pack = pack_name(writer)
        sizes = [arrays[n].box_nbytes(arrays[n].boxes[i]) for n, i in boxes]
        offsets, total, chunk = pack_layout(sizes, chunk_bytes)
        packs[pack] = ArrayInfo(pack, "uint8", (total,), (chunk,), (((0, total),),), raw=True)
        for (n, i), offset in zip(boxes, offsets):
            places[n][i] = (pack, offset)
    for writer, boxes in placed.items():
        for n, _ in boxes:
            arrays[n] = dataclasses.replace(arrays[n], places=tuple(places[n]))
    return {r: ArrayPlan(arrays, frozenset(written[r]), frozenset(designated[r]), packs) for r in world}


def _own_root(shared: ArrayPlan, mine: Mapping[str, Any], rank: int, chunk_bytes: int) -> ArrayPlan:
    """A rank's plan of a root of its own from its part of the shared one: it writes every box it holds (`mine`, as
    described), its placed boxes all in its own pack, in the shared order (without replicas, the shared pack's very
    layout); boxes it does not hold keep their shared places, in other ranks' packs, which this root never holds."""
    boxes = {name: tuple(map(tuple, box)) for name, (_, _, box) in mine.items()}
    order = {name: k for k, name in enumerate(shared.arrays)}
    own = sorted(
        ((n, shared.arrays[n].boxes.index(b)) for n, b in boxes.items() if shared.arrays[n].places and _volume(b)),
        key=lambda p: order[p[0]],
    )
    offsets, total, chunk = pack_layout(
        [shared.arrays[n].box_nbytes(shared.arrays[n].boxes[i]) for n, i in own], chunk_bytes
    )
    pack = pack_name(rank)
    arrays, packs = dict(shared.arrays), {k: v for k, v in shared.packs.items() if k != pack}
    if own:
        packs[pack] = ArrayInfo(pack, "uint8", (total,), (chunk,), (((0, total),),), raw=True)
    for (n, i), offset in zip(own, offsets):
        places = list(arrays[n].places)
        places[i] = (pack, offset)
        arrays[n] = dataclasses.replace(arrays[n], places=tuple(places))
    held = {n: shared.arrays[n].boxes.index(b) for n, b in boxes.items() if _volume(b)}
    return ArrayPlan(arrays, frozenset(boxes), shared.designated, packs, durable=shared, held=held)


def _to_json(plan: ArrayPlan) -> dict[str, Any]:
    """A rank's part as JSON, to send it: the arrays it writes, and its pack."""
    arrays = {n: plan.arrays[n] for n in plan.written}
    own = {pack for a in arrays.values() for pack, _ in a.places or ()}
    return {
        "arrays": {n: [a.dtype, a.shape, a.chunk, a.boxes, a.places, a.segment] for n, a in arrays.items()},
        "packs": {n: [p.shape[0], p.chunk[0]] for n, p in plan.packs.items() if n in own},
        "written": sorted(plan.written),
        "designated": sorted(plan.designated),
    }


def _from_json(d: dict[str, Any]) -> ArrayPlan:
    """A rank's part, as the leader sent it."""

    def box(b: Any) -> Box:
        return tuple((int(lo), int(hi)) for lo, hi in b)

    arrays = {
        n: ArrayInfo(
            n,
            dt,
            tuple(shape),
            tuple(chunk),
            tuple(map(box, boxes)),
            None,
            None if p is None else tuple(map(tuple, p)),
            segment,
        )
        for n, (dt, shape, chunk, boxes, p, segment) in d["arrays"].items()
    }
    packs = {
        n: ArrayInfo(n, "uint8", (total,), (chunk,), (((0, total),),), raw=True)
        for n, (total, chunk) in d["packs"].items()
    }
    return ArrayPlan(arrays, frozenset(d["written"]), frozenset(d["designated"]), packs)


def _volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _starts(boxes: tuple[Box, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(a for a, _ in box) for box in boxes)


@dataclass(frozen=True)
class Band:
    """Rows [lo, hi) of a region that several ranks restore (all of a 0-d one: 0, 1): `reader` reads them from the
    root and sends them to the other `holders` (`tag`: the band's number, the same on every rank)."""

    lo: int
    hi: int
    reader: int
    holders: tuple[int, ...]
    tag: int


Region = tuple[str, Box]  # an array's name and the box of it a rank restores


def share_reads(ranks: Ranks, regions: Mapping[Region, tuple[int, list[int]]] | None) -> dict[Region, tuple[Band, ...]]:
    """Who reads which band of each region held by several ranks. `regions`: this rank's, each with its bytes and
    the rows where a band may start (no byte of the root read twice: the region's digests end there); None where
    this rank could not plan its restore: then nothing is shared and every rank reads its own regions.

    When every rank restores the same regions (DDP: a hash of them agrees), each plans alone; otherwise the leader
    gathers every rank's regions and sends each rank the bands of its shared ones. Regions only one rank holds are
    left out (it reads them itself). Collective: every rank calls it, with the same `ranks`.
    """
    if ranks.world_size == 1:
        return {}
    described = None if regions is None else [[name, box, n, cuts] for (name, box), (n, cuts) in regions.items()]
    key = None if described is None else hashlib.blake2b(json.dumps(described).encode(), digest_size=16).hexdigest()
    keys = ranks.all_gather_json(key)
    if None in keys:
        return {}
    if len(set(keys)) == 1:
        mine = _bands(_held([described], range(ranks.world_size)), ranks.world_size)[ranks.rank]
    else:
        gathered = ranks.gather_json(described)
        mine = ranks.scatter_json(None if gathered is None else _bands(_held(gathered), ranks.world_size))
    return {
        (name, tuple((int(a), int(b)) for a, b in box)): tuple(
            Band(lo, hi, rd, tuple(h), t) for lo, hi, rd, h, t in bands
        )
        for name, box, bands in mine
    }


Held = dict[Region, tuple[int, list[int], list[int]]]  # region -> bytes, rows a band may start at, holders


def _held(gathered: list[Any], holders: range | None = None) -> Held:
    """Every region and its holders, from every rank's regions (JSON), or from one list all `holders` restore."""
    held: Held = {}
    for rank, regions in enumerate(gathered):
        for name, box, n, cuts in regions:
            entry = held.setdefault((name, tuple(map(tuple, box))), (n, cuts, []))
            entry[2].extend([rank] if holders is None else holders)
    return held


def _bands(held: Held, world_size: int) -> list[list[Any]]:
    """Each rank's part of the bands (JSON): a shared region is cut into up to one band per holder at the allowed
    rows nearest to equal parts, and each band goes to the holder with the fewest bytes to read so far, largest
    first (so each of N holders reads about 1/N of the bytes they share)."""
    pieces = []  # (bytes, region, lo, hi, holders)
    for region, (n, cuts, holders) in sorted(held.items()):
        if len(holders) < 2 or not n:
            continue
        box = region[1]
        rows = box[0][1] - box[0][0] if box else 1
        edges = sorted(
            {0, rows}
            | {min(cuts, key=lambda c: abs(c * len(holders) - rows * i)) for i in range(1, len(holders)) if cuts}
        )
        pieces += [(n * (hi - lo) // rows, region, lo, hi, holders) for lo, hi in zip(edges, edges[1:])]
    load = [0] * world_size
    assigned: dict[Region, list[list[Any]]] = {}
    # tags from 1: tag 0 carries the ranks' own collectives (GlooRanks' messages through the leader)
    for tag, (n, region, lo, hi, holders) in enumerate(sorted(pieces, key=lambda p: -p[0]), start=1):
        reader = min(holders, key=lambda r: (load[r], r))
        load[reader] += n
        assigned.setdefault(region, []).append([lo, hi, reader, holders, tag])
    parts: list[list[Any]] = [[] for _ in range(world_size)]
    for (name, box), bands in assigned.items():
        bands.sort()
        for rank in bands[0][3]:
            parts[rank].append([name, box, bands])
    return parts
