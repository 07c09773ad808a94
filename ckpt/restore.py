"""Mechanism of one restore, the mirror of `save.py`: `plan_restore` (manifest + target -> ReadPlan), `execute`
(verified reads into buffers of its own), `apply` (into the caller's state).

All or nothing for the caller: every chunk a restore needs is checked (size, crc32c, the manifest's digest), and
the caller's tensors hold the step's values only once every read of every rank verified, else what they held
before. A region whose tensor is a plain contiguous CPU tensor of its own memory is read straight into it, after
its old bytes were copied aside into the staging arena (on a thread of its own, ahead of the disk, so the copy
costs no time of the restore's); a failed step copies them back (`ReadPlan.undo`). Other regions are read into
scratch (the arena, or a tensor of its own where the caller has none), which `apply` copies into the caller's
tensors. A region several ranks restore from a root they share (replicas) is read once: each of its bands by one
of them, sent to the others over the ranks' group (`planner.share_reads` plans who reads what). The manager (policy)
picks the step and handles failures.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import queue
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from . import layout, packs, planner, store
from . import state as state_mod
from .distributed import Ranks, ShardedLike, is_dtensor, leader_reads, read_region, restore_template
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DataMismatchError,
    PartialCopyError,
    StateKeyError,
    StateMismatchError,
    StepNotFoundError,
    described,
)
from .format import ArrayInfo, Manifest, chunk_key, torch_dtype
from .layout import StepFiles, step_files  # noqa: F401 (restore.step_files, as before)
from .staging import StagingArena
from .storage import Storage, where

Box = tuple[tuple[int, int], ...]
log = logging.getLogger("ckpt")
MAX_RELISTS = 100  # steps vanishing under a reader (restore, load), in a row, before it gives up


def relisted(url: str, relists: int) -> int:
    """`relists` + 1: the times a reader of the root `url` listed its steps again after one vanished under it; past
    MAX_RELISTS a CheckpointError (another process deletes them as fast as they are read)."""
    relists += 1
    if relists > MAX_RELISTS:
        raise CheckpointError(
            f"steps of {url} vanished while being read, {relists} times: is another process deleting them?"
        )
    return relists


@dataclass
class ArrayRead:
    """One region of one array to read, and the caller's tensors it lands in once the whole step verified."""

    info: ArrayInfo
    box: Box
    targets: list[torch.Tensor] = field(default_factory=list)  # copied into by `apply`
    fresh: torch.Tensor | None = None  # the value itself where the caller had no tensor: read into directly
    buffer: torch.Tensor | None = None  # where the reads go: `fresh`, the first target (`saved`), or scratch
    saved: torch.Tensor | None = None  # the first target's bytes before the read, when it is read into directly

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.info.itemsize


@dataclass
class ReadPlan:
    """What a restore reads from one step and the values it then applies to the caller's state."""

    manifest: Manifest
    reads: dict[tuple[str, Box], ArrayRead]
    values: dict[str, Any]  # top-level key -> decoded value (tensors: the caller's own, or fresh ones)
    bands: dict[tuple[str, Box], tuple[planner.Band, ...]] = field(default_factory=dict)  # regions shared with ranks
    _held: "_HeldInterrupts | None" = None

    def hold_interrupts(self) -> None:
        """Once every read verified: a Ctrl-C waits until the plan is undone or released (`_HeldInterrupts`)."""
        if self._held is None:
            self._held = _HeldInterrupts()

    def undo(self, *, let_go: bool = True) -> None:
        """Give the tensors read into directly their bytes from before the restore back (a step that failed); then,
        unless the caller gives more back first (`let_go=False`, then `release`), a held Ctrl-C acts."""
        for r in self.reads.values():
            if r.saved is not None:
                r.targets[0].detach().copy_(r.saved)
                r.saved = None
        if let_go:
            self._let_go()

    def release(self) -> None:
        """Drop the references to scratch and to the bytes set aside, once applied: their host memory goes back
        with the arena's at `close`, not whenever the garbage collector next finds the restore's cycles."""
        for r in self.reads.values():
            r.saved = None
            r.buffer = r.fresh
        self._let_go()

    def _let_go(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.let_go()


class _HeldInterrupts:
    """SIGINT (Ctrl-C) held back from a verified read until it has landed whole in the caller's state, or been given
    back: between those, half a state could be neither undone nor completed. The signal then acts as it would have
    (KeyboardInterrupt). Only where Python runs signal handlers, the main thread; elsewhere nothing is held."""

    def __init__(self) -> None:
        self._held = threading.current_thread() is threading.main_thread()
        self._got = False
        # None: a handler set outside Python, which signal.signal cannot put back (the default then)
        self._previous = signal.signal(signal.SIGINT, self._note) if self._held else None

    def _note(self, signum: int, frame: Any) -> None:
        self._got = True

    def let_go(self) -> None:
        if not self._held:
            return
        self._held, previous = False, self._previous
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if self._got and callable(previous):
            previous(signal.SIGINT, None)
        elif self._got and previous in (signal.SIG_DFL, None):
            signal.raise_signal(signal.SIGINT)


def plan_restore(
    manifest: Manifest,
    target: Mapping[str, Any],
    keys: Sequence[str] | None,
    ranks: Ranks,
    *,
    rank_map: str = "modulo",
    files: StepFiles | None = None,
) -> ReadPlan:
    """Decide every read of a restore of `keys` (default: all) of `target`; reads nothing, changes nothing.

    DTensor targets read only their own shard's region of each global array (any world size); other
    tensors read whole arrays. Per-rank entries follow `state.select_rank`. Key, shape and dtype mismatches
    raise here (StateKeyError, StateMismatchError naming the key). With `files` (of a local step), every chunk of every
    region read must be there at its exact size before a byte is read (else CorruptCheckpointError); a rank's
    local tier holds only the regions that rank holds.
    """
    tree, step = manifest.tree, manifest.step
    selected = list(keys) if keys is not None else list(target)
    missing = [k for k in selected if k not in tree]
    if missing:
        dotted = next((k for k in missing if isinstance(k, str) and k.split(".")[0] in tree), None)
        hint = (
            f"; restore's keys are top-level entries: restore {dotted.split('.')[0]!r} whole, or read {dotted!r} "
            f"with ckpt.load(root, keys=[{dotted!r}])"
            if dotted is not None
            else ""
        )
        raise StateKeyError(f"keys {missing} not in checkpoint step {step} (it has {sorted(tree)}){hint}")
    absent = [k for k in selected if k not in target]
    if absent:
        raise StateKeyError(f"keys {absent} are not in the state passed to restore (it has {sorted(target)})")
    nodes = {}
    for k in selected:
        node = tree[k]
        if state_mod.node_of(node).kind == state_mod.PER_RANK:
            node = state_mod.select_rank(node, ranks.rank, manifest.world_size, ranks.world_size, rank_map)
            if node is None:
                continue
        nodes[k] = node
    reads: dict[tuple[str, Box], ArrayRead] = {}

    def read(name: str, box: Box) -> ArrayRead:
        """The read of a region, planned once; its files checked first (before a fresh tensor is allocated)."""
        if (name, box) not in reads:
            _check_held(manifest, name, box)
            if files is not None:
                _check_files(manifest.arrays[name], box, manifest, files)
            reads[name, box] = ArrayRead(manifest.arrays[name], box)
        return reads[name, box]

    def plan_read(name: str, template: Any, as_numpy: bool, key: str) -> Any:
        """A tensor reference met by `state.decode`: plan its read (no IO) and give the value the state will hold."""
        info = manifest.arrays[name]
        ours = isinstance(template, ShardedLike)  # a tensor this restore makes: nothing of the caller's to set aside
        if ours:
            template = template.tensor(info)
        in_place = (
            isinstance(template, np.ndarray) and template.flags.writeable and min(template.strides, default=0) >= 0
        )
        tmpl = torch.from_numpy(template) if in_place else template  # else (read-only, or negative strides, which
        # torch cannot view) a new array takes its place in the state
        shard = read_region(info, tmpl, key)
        if shard is not None:
            dtensor, box = shard
            _check_match(info, dtensor, step, key)
            r = read(name, box)
            if ours and r.fresh is None and not r.targets:
                r.fresh = dtensor.to_local()
            else:
                _add_target(r, dtensor.to_local())
            return dtensor
        whole = tuple((0, n) for n in info.shape)
        r = read(name, whole)
        if isinstance(tmpl, torch.Tensor):
            _check_match(info, tmpl, step, key)
            if torch._debug_has_internal_overlap(tmpl) == 1:  # copy_ refuses it, after other targets were written
                raise StateMismatchError(
                    f"restore of key {key!r} (step {step}): the target tensor's elements share memory (an "
                    f"expanded view, strides {list(tmpl.stride())}): it cannot hold {list(info.shape)} distinct "
                    "values; restore into a tensor of its own"
                )
            _add_target(r, tmpl)
            value = tmpl
        elif r.targets:  # a second reference to an array already read into the caller's tensor: tied stays tied
            value = r.targets[0]
        else:
            if r.fresh is None:
                r.fresh = _fresh(info, whole, step, key)
            value = r.fresh
        return value.numpy() if as_numpy else value

    values = {
        k: state_mod.decode(node, plan_read, target[k], k, strict=True, state_of=restore_template)
        for k, node in nodes.items()
    }
    if keys is None:
        extra = [k for k in tree if k not in target]
        if extra:
            raise StateKeyError(
                f"checkpoint step {step} has keys {extra} that the state passed to restore lacks: add "
                f"them, or restore only some keys with keys=[...]"
            )
    # here, before any read: among ranks `agree` tells every rank a refusal
    for path, obj, v in checked(target, values):
        try:
            obj.check_state_dict(v)
        except DataMismatchError as e:  # which of several samplers, of which step
            raise DataMismatchError(f"restore of key {path!r} (step {step}): {e}") from None
    return ReadPlan(manifest, reads, values)


def checked(target: Mapping[str, Any], values: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key path, object, its restored state) of every object at any depth of `target` that can check a state
    without taking it (`check_state_dict`: the samplers). `plan_restore` checks them, so that a sampler over other
    data on one rank fails the restore on every rank before anything is read; `apply` loads them last of all."""
    return [
        (path, obj, v)
        for k in values
        for path, obj, v in state_mod.stateful_in(target, k, values[k])
        if callable(getattr(obj, "check_state_dict", None))
    ]


def _check_held(manifest: Manifest, name: str, box: Box) -> None:
    """A rank's own root holds the region to read (`Manifest.held`): else `PartialCopyError`, before any read."""
    if manifest.held is None:
        return
    info, held = manifest.arrays[name], manifest.held.get(name)
    have = None if held is None else info.boxes[held]
    if have is None or any(a < lo or b > hi for (a, b), (lo, hi) in zip(box, have)):
        holds = "none of it" if have is None else f"the region {[list(r) for r in have]}"
        raise PartialCopyError(
            f"step {manifest.step} here is one rank's own copy of a {manifest.world_size}-rank save (a local tier or "
            f"a peer's replica): of array {name!r} {list(info.shape)} it holds {holds}, and this restore needs "
            f"{[list(r) for r in box]}; restore it with the manager of the run (local= this tier) at the world size "
            "and sharding it was saved with, or from the durable root"
        )


def _check_files(info: ArrayInfo, box: Box, manifest: Manifest, files: StepFiles) -> None:
    """Every chunk file the read of `box` of `info` needs is there at its exact size, beside its zarr.json (its
    packs' files, where its boxes are placed)."""
    if info.places is None:
        base = layout.array_dir(info.name, manifest.data)
        needed = [(base, info, f"{base}/{chunk_key(index)}") for index in info.chunks(box)]
    else:
        needed = []
        for j in _overlapping(info, box):
            pack = manifest.packs[info.places[j][0]]
            base = layout.pack_dir(pack.name, manifest.data)
            start, n = info.places[j][1], info.box_nbytes(info.boxes[j])
            needed += [(base, pack, f"{base}/{chunk_key((k,))}") for k in packs.files_needed(pack, start, n)]
    for base in dict.fromkeys(base for base, _, _ in needed):
        if f"{base}/zarr.json" not in files.sizes:
            raise CorruptCheckpointError(
                "zarr.json is missing", step=manifest.step, key=info.name, file=f"{files.dir}/{base}/zarr.json"
            )
    for _, expected, path in needed:
        size = files.sizes.get(path)
        if size != expected.file_nbytes:
            raise CorruptCheckpointError(
                "chunk file is missing"
                if size is None
                else f"chunk file has {size} bytes, expected {expected.file_nbytes}",
                step=manifest.step,
                key=info.name,
                file=f"{files.dir}/{path}",
            )


def _overlapping(info: ArrayInfo, box: Box) -> list[int]:
    """The stored boxes of a placed array that share an element with `box`."""
    return [j for j, b in enumerate(info.boxes) if _intersect(b, box) is not None]


def _intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, None when it is empty (a 0-d box meets only itself)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _add_target(r: ArrayRead, t: torch.Tensor) -> None:
    """Another tensor to receive the read, unless it views the same memory as one already there (tied)."""
    view = (t.device, t.data_ptr(), t.stride())
    if all((x.device, x.data_ptr(), x.stride()) != view for x in r.targets):
        r.targets.append(t)


def _fresh(info: ArrayInfo, box: Box, step: int, key: str) -> torch.Tensor:
    """A tensor of its own for an array the caller has none for; never larger than this machine's memory."""
    shape = tuple(b - a for a, b in box)
    nbytes = math.prod(shape) * info.itemsize
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > memory:
        raise CheckpointError(
            f"restore of key {key!r} (step {step}) needs {nbytes} bytes of new memory, more "
            f"than this machine has ({memory}); restore it into an existing tensor"
        )
    return torch.empty(shape, dtype=torch_dtype(info.dtype))


def _check_dense_target(info: ArrayInfo, t: torch.Tensor, step: int, key: str) -> None:
    """A restore writes a tensor in place, so the caller's must have memory laid out densely: a meta tensor (a model
    built on ``torch.device("meta")`` and not yet materialized) has none, and copying into it does nothing, so the
    restore would report success while the state kept no value; a sparse or nested one has no such layout (torch
    fails the copy, after other tensors were written, or names no key)."""
    what = (
        "a nested tensor"
        if t.is_nested
        else f"a {t.layout} (sparse) tensor"
        if t.layout != torch.strided
        else "a meta tensor, which has no memory to restore into (materialize it first, e.g. "
        "module.to_empty(device=...))"
        if t.is_meta
        else None
    )
    if what:
        raise StateMismatchError(
            f"restore of key {key!r} (step {step}): checkpoint has a dense {info.dtype} array of shape "
            f"{list(info.shape)}, the target tensor is {what}"
        )


def _check_match(info: ArrayInfo, tmpl: torch.Tensor, step: int, key: str) -> None:
    """The caller's tensor at `key` (its dotted path, which errors name) can take the array in place: dense memory of
    its own, the array's shape and dtype."""
    _check_dense_target(info, tmpl.to_local() if is_dtensor(tmpl) else tmpl, step, key)
    if tuple(tmpl.shape) != info.shape:
        raise StateMismatchError(
            f"restore of key {key!r} (step {step}): checkpoint has shape {list(info.shape)}, "
            f"the target tensor has shape {list(tmpl.shape)}"
        )
    if tmpl.dtype != torch_dtype(info.dtype):
        raise StateMismatchError(
            f"restore of key {key!r} (step {step}): checkpoint has dtype {info.dtype}, "
            f"the target tensor has dtype {str(tmpl.dtype).removeprefix('torch.')}"
        )


def execute(
    storage: Storage, plan: ReadPlan, pool: ThreadPoolExecutor, arena: StagingArena, ranks: Ranks | None = None
) -> None:
    """Read and verify every region of the plan into its buffer; the caller's tensors are not touched.

    Regions with caller tensors are read into scratch (the staging arena), or straight into the first of them once
    its bytes are aside (`_direct_targets`); regions without, into their own fresh tensors. Local whole-row regions
    of arrays of their own go straight from the chunk files (`preadv`), others chunk by chunk; boxes placed in packs
    by ranges of the pack's files (`packs.read_boxes`), into the buffer where the box is a band of the region read,
    else into memory of their own, copied into it once verified. Of a region shared with other `ranks`
    (`plan.bands`), this rank reads its bands and sends them to the other holders, and receives the others' bands:
    every rank takes part in the exchange even when its reads failed (the ranks' agreement then fails the step on
    all). Every read runs to its end, so the error raised is the first damaged array's, not a random one.
    """
    ranks = ranks or Ranks.local()
    rank = ranks.rank
    step = plan.manifest.step
    pending = [r for r in plan.reads.values() if r.fresh is None]
    direct = _direct_targets(pending)
    for r, buf in zip(pending, arena.scratch([r.nbytes for r in pending])):
        r.buffer = buf.view(torch_dtype(r.info.dtype)).view(r.shape)
    aside = _SetAside([r for r in pending if id(r) in direct])
    for r in plan.reads.values():
        if r.fresh is not None:
            r.buffer = r.fresh
    aside.start()  # first: a read into a caller's tensor waits for its bytes to be aside
    futures: list[Future] = []
    try:  # from the first read submitted: an interrupt (Ctrl-C) anywhere stops the reads and gives every byte back
        exchange = _Exchange(plan, ranks, aside)
        placed = _PlacedReads(aside)
        for key, r in plan.reads.items():
            bands = plan.bands.get(key)
            parts = [(None, r)] if not bands else [(b, _band(r, b)) for b in bands if b.reader == rank]
            if r.info.places is not None:
                for band, part in parts:
                    exchange.expect(band, part.nbytes)
                    placed.add(part, r, functools.partial(exchange.landed, band))
                continue
            if not parts:
                continue
            path = layout.array_path(step, r.info.name, plan.manifest.data)
            futures.append(pool.submit(store.check_zarr_json, storage, path, r.info, step=step))
            local = storage.direct_path(path)
            into = aside.reads_of(r, pool)
            for band, part in parts:
                rows = store.direct_rows(r.info, part.box) if local is not None else None
                reads = []
                if rows is not None:
                    reads = store.read_direct(local, r.info, part.buffer, rows, into, step=step)
                elif part.buffer.numel():
                    reads = store.read_chunks(storage, path, r.info, part.buffer, part.box, into, step=step)
                exchange.expect(band, len(reads))
                for f in reads:
                    f.add_done_callback(functools.partial(exchange.verified, band))
                futures += reads
        manifest = plan.manifest
        for name in dict.fromkeys(placed.packs()):
            pack_path = layout.pack_path(step, name, manifest.data)
            futures.append(pool.submit(store.check_zarr_json, storage, pack_path, manifest.packs[name], step=step))
        futures += packs.read_boxes(
            storage,
            manifest.packs,
            lambda name: layout.pack_path(step, name, manifest.data),
            placed.boxes,
            pool,
            step=step,
        )
        exchange.start()
        errors = []
        for f in futures:
            try:
                f.result()
            except Exception as e:
                errors.append(e)
    except BaseException:  # Ctrl-C: once restore has raised, no read may go on writing into the caller's tensors
        for f in futures:
            f.cancel()
        futures_wait(futures)
        aside.join()
        plan.undo()
        raise
    if any(r.targets for r in plan.reads.values()):  # the caller's tensors: from here given back or applied whole
        plan.hold_interrupts()  # (`apply` releases the plan, or `undo`; a read into tensors of its own needs neither)
    aside.join()
    if not errors and aside.error is None:
        placed.apply()
    try:
        exchange.finish()
    except Exception as e:
        errors.append(e)
    if not errors and aside.error is None:
        return
    plan.undo()
    raise errors[0] if errors else aside.error


def _band(r: ArrayRead, band: planner.Band) -> ArrayRead:
    """Rows [lo, hi) of region `r` as a read of its own, into those rows of `r`'s buffer."""
    if not r.box or (band.lo, band.hi) == (0, r.shape[0]):
        return r
    (a, _), rest = r.box[0], r.box[1:]
    return ArrayRead(r.info, ((a + band.lo, a + band.hi), *rest), buffer=r.buffer[band.lo : band.hi])


def _cuts(r: ArrayRead) -> list[int]:
    """The rows of region `r` where a band of it may start with no byte of the root read twice: where a digest of
    the one stored box it is ends (a placed array), or a chunk (an array of its own)."""
    if not r.box or r.box[0][0] == r.box[0][1]:
        return []
    (a, b), info = r.box[0], r.info
    if info.places is None:
        return [x - a for x in range((a // info.chunk[0] + 1) * info.chunk[0], b, info.chunk[0])]
    stored = _overlapping(info, r.box)
    if len(stored) != 1 or info.boxes[stored[0]] != r.box:
        return []
    row = r.nbytes // (b - a)
    return [lo // row for lo, _, _ in info.segments(stored[0])[1:] if lo % row == 0]


BATCH_BYTES = 1 << 20  # bands smaller than this travel together: one message per reader and set of holders


@dataclass
class _Message:
    """Bands that travel together from their reader to the other holders: one band, or the small bands of one reader
    and set of holders (copied into one buffer to send, out of one once received). `tag`: its first band's."""

    reader: int
    holders: tuple[int, ...]
    pieces: list[tuple[int, ArrayRead, torch.Tensor]] = field(default_factory=list)  # band tag, region, its bytes
    waiting: int = 0  # bands of it not yet whole (the reader's side)

    @property
    def tag(self) -> int:
        return self.pieces[0][0]

    @property
    def batched(self) -> bool:
        return len(self.pieces) > 1 or self.pieces[0][2].numel() < BATCH_BYTES


class _Exchange:
    """This rank's part of the exchange of the bands of shared regions (`plan.bands`), while the reads run: a message
    another rank reads is received once its regions' targets are aside (a batch into memory of its own, copied out
    at the end; into memory of its own, dropped, when the set aside failed); a message this rank reads is sent to the
    other holders once all of its bands verified, or when the reads ended (a band copied into its buffer after the
    reads, or one whose read failed: every rank still takes part, and the ranks' agreement fails the step on all).
    Sends and receives are started on threads of their own."""

    def __init__(self, plan: ReadPlan, ranks: Ranks, aside: "_SetAside"):
        self.ranks, self.aside = ranks, aside
        messages: dict[tuple[int, ...], _Message] = {}
        for key, bands in plan.bands.items():
            r = plan.reads[key]
            for b in bands:
                data = (r.buffer[b.lo : b.hi] if r.box else r.buffer).reshape(-1).view(torch.uint8)
                if data.numel():
                    group = (b.tag,) if data.numel() >= BATCH_BYTES else (b.reader, *b.holders)
                    messages.setdefault(group, _Message(b.reader, b.holders)).pieces.append((b.tag, r, data))
        for m in messages.values():
            m.pieces.sort(key=lambda p: p[0])  # the same order on every holder
            m.waiting = len(m.pieces)
        self._sends = {m.tag: m for m in messages.values() if m.reader == ranks.rank}
        self._receives = [m for m in messages.values() if m.reader != ranks.rank]
        self._of = {tag: m for m in self._sends.values() for tag, _, _ in m.pieces}  # band tag -> its message
        self._expected: dict[int, int] = {}  # band tag -> what lands before it is whole (bytes, or reads)
        self._got: dict[int, int] = dict.fromkeys(self._of, 0)
        self._started = False
        self._lock = threading.Lock()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # messages read whole, then None: the reads ended
        self._works: list[tuple[Any, torch.Tensor]] = []  # each transfer, and the bytes it holds on to
        self._batches: list[tuple[_Message, torch.Tensor]] = []  # received batches, to copy out
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(f,), name=f"ckpt-restore-{f.__name__[1:]}", daemon=True)
            for f in (self._send, self._receive)
        ]

    def expect(self, band: planner.Band | None, amount: int) -> None:
        """The band this rank reads is whole once `amount` landed (`landed`); None: a region of its own."""
        if band is not None and band.tag in self._of:
            self._expected[band.tag] = amount

    def landed(self, band: planner.Band | None, amount: int) -> None:
        """Part of a band verified in its buffer (a reader thread); its message is sent once all of it did."""
        if band is not None and band.tag in self._of:
            with self._lock:
                self._got[band.tag] += amount
                self._whole(band.tag)

    def verified(self, band: planner.Band | None, read: Future) -> None:
        """One of a band's chunk reads ended (`landed` when it verified)."""
        if read.exception() is None:
            self.landed(band, 1)

    def _whole(self, tag: int) -> None:
        """Under the lock: count band `tag` whole, once, when all it expects landed (and every band is expected)."""
        if self._started and self._got[tag] == self._expected.get(tag):
            m = self._of[tag]
            m.waiting -= 1
            if not m.waiting:
                self._ready.put(m.tag)

    def start(self) -> None:
        """Every band is expected: the bands that landed already count, and the transfers begin."""
        with self._lock:
            self._started = True
            for tag in self._of:
                self._whole(tag)
        if self._sends or self._receives:
            for t in self._threads:
                t.start()

    def finish(self) -> None:
        """The reads ended (verified or not): the messages not sent yet go now; returns once every transfer ended,
        the batches received copied into their regions' buffers."""
        if not (self._sends or self._receives):
            return
        self._ready.put(None)
        for t in self._threads:
            t.join()
        for w, _ in self._works:
            w.wait()
        if self._errors:
            raise self._errors[0]
        for m, buffer in self._batches:
            at = 0
            for _, r, data in m.pieces:
                try:
                    self.aside.wait(r)
                    data.copy_(buffer[at : at + data.numel()])
                except RuntimeError:  # its target's bytes are not aside: they must not be written
                    pass
                at += data.numel()

    def _run(self, post: Any) -> None:
        try:
            post()
        except BaseException as e:
            self._errors.append(e)

    def _send(self) -> None:
        sent: set[int] = set()
        while (tag := self._ready.get()) is not None:
            sent.add(tag)
            self._post(self._sends[tag])
        for tag, m in self._sends.items():
            if tag not in sent:
                self._post(m)

    def _post(self, m: _Message) -> None:
        data = torch.cat([d for _, _, d in m.pieces]) if m.batched else m.pieces[0][2]
        self._works += [(self.ranks.send(data, peer, m.tag), data) for peer in m.holders if peer != self.ranks.rank]

    def _receive(self) -> None:
        for m in self._receives:
            if m.batched:
                data = torch.empty(sum(d.numel() for _, _, d in m.pieces), dtype=torch.uint8)
                self._batches.append((m, data))
            else:
                _, r, data = m.pieces[0]
                try:
                    self.aside.wait(r)
                except RuntimeError:  # its target's bytes are not aside: they must not be written
                    data = torch.empty_like(data)
            self._works.append((self.ranks.receive(data, m.reader, m.tag), data))


def _nothing(n: int) -> None:
    """Told of bytes no one waits for."""


class _PlacedReads:
    """The box reads of the regions of placed arrays: each stored box that a region needs, read once per region,
    into the region's buffer where it is a band of it, else into memory of its own (`apply` copies it in)."""

    def __init__(self, aside: "_SetAside"):
        self.aside = aside
        self.boxes: list[packs.BoxRead] = []
        self._copies: list[tuple[ArrayRead, int, int, tuple[int, int], np.ndarray]] = []

    def add(self, r: ArrayRead, owner: ArrayRead, landed: Callable[[int], None]) -> None:
        """The reads of region `r` (a band of region `owner`, or `owner` itself): of each stored box that meets it,
        the segments that hold its rows there. `landed(n)`: n bytes verified in `r`'s buffer (those read into
        memory of their own are not: `apply` copies them in)."""
        out = store.as_bytes(r.buffer)
        for j in _overlapping(r.info, r.box):
            stored = r.info.boxes[j]
            part = _intersect(stored, r.box)
            row = r.info.box_nbytes(stored[1:])  # a 0-d box is one "row" of its one item
            need = ((part[0][0] - stored[0][0]) * row, (part[0][1] - stored[0][0]) * row) if stored else (0, row)
            segments = r.info.segments(j, *need)
            lo, hi = segments[0][0], segments[-1][1]
            if (lo, hi) == need and stored[1:] == r.box[1:]:  # whole rows of the region: straight into its buffer
                at = (part[0][0] - r.box[0][0]) * row if stored else 0
                dest, told = out[at : at + hi - lo], landed
            else:  # in the buffer only once copied
                dest, told = np.empty(hi - lo, np.uint8), _nothing
                self._copies.append((r, j, lo, need, dest))
            ready = functools.partial(self.aside.wait, owner)
            self.boxes.append(packs.BoxRead(r.info, j, lo, hi, memoryview(dest), ready, told))

    def packs(self) -> list[str]:
        return [b.info.places[b.box][0] for b in self.boxes]

    def apply(self) -> None:
        """Copy the rows of verified stored boxes read into memory of their own into their regions' buffers."""
        for r, j, lo, (first, end), data in self._copies:
            stored = r.info.boxes[j]
            part = _intersect(stored, r.box)
            rows = data[first - lo : end - lo]
            value = store.typed(rows, r.info.dtype, (part[0][1] - part[0][0], *(b - a for a, b in stored[1:])))
            out = store.typed(store.as_bytes(r.buffer), r.info.dtype, r.shape)
            out[tuple(slice(lo_ - a, hi_ - a) for (lo_, hi_), (a, _) in zip(part, r.box))] = value[
                (slice(None),) + tuple(slice(lo_ - a, hi_ - a) for (lo_, hi_), (a, _) in zip(part[1:], stored[1:]))
            ]


def _direct_targets(reads: Sequence[ArrayRead]) -> set[int]:
    """The reads (by id) whose first target can be read into directly: a contiguous CPU tensor of the read's dtype
    and shape, not a conjugate view, whose bytes no other read's target shares (tied or overlapping views stay read
    into scratch)."""
    spans: dict[int, tuple[int, int]] = {}
    for r in reads:
        t = r.targets[0] if r.targets else None
        if (
            t is not None
            and t.device.type == "cpu"
            and t.is_contiguous()
            and not (t.is_conj() or t.is_neg())  # a lazy conjugate (or negative) view: its bytes are not its values
            and t.dtype == torch_dtype(r.info.dtype)
            and tuple(t.shape) == r.shape
            and t.numel() > 0
        ):
            spans[id(r)] = (t.data_ptr(), t.data_ptr() + r.nbytes)
    # every other target's whole storage (a strided view may reach anywhere in it)
    others = [x for r in reads for x in (r.targets if id(r) not in spans else r.targets[1:])]
    extents = [(lo, hi, key) for key, (lo, hi) in spans.items()]
    extents += [(s.data_ptr(), s.data_ptr() + s.nbytes(), None) for s in (x.untyped_storage() for x in others)]
    clash: set[int | None] = set()
    reach, owner = -1, None  # the furthest end so far, and whose
    for lo, hi, key in sorted(extents, key=lambda e: (e[0], e[1])):
        if lo < reach:  # overlaps the extent that reaches furthest (sorted by start: it starts no later)
            clash |= {key, owner}
        if hi > reach:
            reach, owner = hi, key
    return set(spans) - clash


class _SetAside:
    """Copies the first target of each direct read aside (into the read's scratch buffer, which then becomes its
    `saved` bytes) on a thread of its own, in read order; a read's writes into its target wait for its copy."""

    def __init__(self, reads: list[ArrayRead]):
        self.reads, self.error = reads, None
        self._done = {id(r): threading.Event() for r in reads}
        for r in reads:  # from now on the read goes into the caller's tensor
            r.saved, r.buffer = r.buffer, r.targets[0].detach()
        self._thread = threading.Thread(target=self._run, name="ckpt-restore-aside", daemon=True)

    def reads_of(self, r: ArrayRead, pool: ThreadPoolExecutor) -> Any:
        """Where the reads of `r` are submitted: `pool`, each task after `r`'s target was copied aside."""
        return pool if id(r) not in self._done else _After(pool, r, self)

    def wait(self, r: ArrayRead) -> None:
        """Before a write into `r`'s buffer: its target's bytes are aside (the copy failed: stop)."""
        if id(r) in self._done:
            self._done[id(r)].wait()
            if self.error is not None:
                raise RuntimeError("restore stopped: a target could not be copied aside") from self.error

    def start(self) -> None:
        if self.reads:
            self._thread.start()

    def join(self) -> None:
        if self.reads:
            self._thread.join()

    def _run(self) -> None:
        try:
            for r in self.reads:
                r.saved.copy_(r.buffer)
                self._done[id(r)].set()
        except BaseException as e:  # no read may write a target whose bytes are not aside: they all stop
            self.error = e
        finally:
            for r in self.reads:
                if not self._done[id(r)].is_set():
                    r.saved = None  # nothing to undo: its target was never written
                    self._done[id(r)].set()


class _After:
    """A pool whose tasks first wait until `read`'s target is aside (and refuse to run when the copy failed)."""

    def __init__(self, pool: ThreadPoolExecutor, read: ArrayRead, aside: _SetAside):
        self.pool, self.read, self.aside = pool, read, aside

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Future:
        def run() -> Any:
            self.aside.wait(self.read)
            return fn(*args, **kwargs)

        return self.pool.submit(run)


def apply(plan: ReadPlan, target: dict[str, Any]) -> None:
    """Land a verified read in the caller's state: copy each buffer into its tensors, then set or load values.

    A Stateful object's own `load_state_dict` may still refuse (a sampler over other data, a scheduler of another
    kind). Objects that can check a state without taking it (`check_state_dict`: the samplers, whose live iterator
    a load ends), at any depth of the state, were checked by `plan_restore` before any read, and load last of all;
    first the objects whose state holds none of the tensors copied here load (schedulers, RNG states: nothing of the
    caller's changed yet but the tensors read into directly), then the copies, the other objects (modules,
    optimizers: `state.decode` checked their keys, shapes and groups), the plain values (and the objects nested in
    them), the checked objects. When a
    load raises, the objects loaded so far get their state from before back and so do the tensors read into
    directly; when tensors were copied into here (CUDA, strided or tied ones) and a load after the copies raises,
    nothing is given back (every object keeps the step's values: a consistent state, as the docs say)."""
    copied = [(r, t) for r in plan.reads.values() for t in (r.targets[1:] if r.saved is not None else r.targets)]
    into = {(t.device, t.untyped_storage().data_ptr()) for _, t in copied}
    checks = checked(target, plan.values)  # at any depth: a sampler in a dict loads after its siblings
    deferred = {id(obj) for _, obj, _ in checks}
    stateful = [k for k in plan.values if state_mod.is_stateful(target.get(k)) and id(target[k]) not in deferred]
    first = [k for k in stateful if not _holds(plan.values[k], into)]
    loaded: list[tuple[Any, Any]] = []
    copied_yet = False
    try:
        for k in first:
            loaded.append(_before(target[k]))
            state_mod.apply(target, k, plan.values[k])
        copied_yet = True
        with torch.no_grad():  # a leaf that requires grad (a strided one: not read into directly) takes its bytes
            for r, t in copied:  # a direct read's first target already holds it
                # an inference tensor (made under torch.inference_mode) takes an in-place write only inside it (not
                # inference_mode(False) for the others: it turns grad mode back on, and a leaf's copy raises)
                with torch.inference_mode() if t.is_inference() else contextlib.nullcontext():
                    t.copy_(r.buffer, non_blocking=t.is_cuda)
        for device in {t.device for _, t in copied if t.is_cuda}:  # each target's device, not only the current one:
            torch.cuda.synchronize(device)  # the scratch buffers are freed (and reused) after this
        for k in (k for k in stateful if k not in first):
            loaded.append(_before(target[k]))
            state_mod.apply(target, k, plan.values[k])
        for k, v in plan.values.items():
            if k not in stateful:
                state_mod.apply(target, k, v, skip=deferred)
        for _, obj, v in checks:  # last: a load its check passed takes the state whole or, raising, changes nothing
            obj.load_state_dict(v)
    except BaseException:
        if not (copied_yet and copied):  # else bytes that cannot be given back: every object keeps the step's values
            plan.undo(let_go=False)
            for obj, state in reversed(loaded):
                try:
                    obj.load_state_dict(state)
                except Exception as e:  # the error that stopped the restore is the one to raise
                    log.warning("restore failed, and %s could not be given its state back: %s", type(obj).__name__, e)
        plan.release()
        raise
    plan.release()  # last: a Ctrl-C held back until the state is whole is raised here


def _holds(value: Any, storages: set[tuple[torch.device, int]]) -> bool:
    """Whether a decoded value holds a tensor whose memory is one of `storages` (device, storage address), or a numpy
    array (which may view one: such objects load after the copies, as before)."""
    for a in _arrays(value):
        if isinstance(a, np.ndarray):
            return True
        t = a.to_local() if is_dtensor(a) else a
        if (t.device, t.untyped_storage().data_ptr()) in storages:
            return True
    return False


def _before(obj: Any) -> tuple[Any, Any]:
    """An object and its state before a load, to give back if the restore fails: containers copied, tensors and
    numpy arrays held as they are (their bytes are given back by `ReadPlan.undo`)."""
    state = obj.state_dict()
    return obj, copy.deepcopy(state, memo={id(a): a for a in _arrays(state)})


def _arrays(value: Any) -> Iterator[Any]:
    """The tensors and numpy arrays in a value, through its dicts, lists and tuples."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _arrays(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


def read_step(
    storage: Storage,
    step: int,
    state: Mapping[str, Any],
    keys: Sequence[str] | None,
    ranks: Ranks,
    rank_map: str,
    readers: ThreadPoolExecutor,
    arena: StagingArena,
    *,
    shared: bool = False,
) -> tuple[ReadPlan | None, Exception | None]:
    """This rank's read of `step`, the mirror of a save: manifest, plan, verified reads; or why it failed.

    `shared`: every rank reads `storage` (one root for all), so its manifest is read and its files listed once, by the
    leader (`shared_step`), and a region several ranks restore is read once and exchanged (`planner.share_reads`);
    collective: then every rank calls this. A mismatch between `state` and the
    checkpoint (StateKeyError, StateMismatchError) is found before anything is read: alone it is raised here; among
    ranks it is returned, as damage and a `PartialCopyError` are, so that `agree` tells every rank (none waits for
    this one); so is a read that failed for another reason (an I/O error). Nothing is applied to `state`.
    """
    plan, error, bands = None, None, {}
    try:
        if shared and ranks.world_size > 1:
            manifest, files = shared_step(storage, step, ranks)
        else:
            manifest = layout.read_manifest(storage, step)
            files = step_files(storage, step)
        plan = plan_restore(manifest, state, keys, ranks, rank_map=rank_map, files=files)
    except (CorruptCheckpointError, StepNotFoundError, PartialCopyError) as e:  # the next copy or step may do
        error = e
    except Exception as e:
        if ranks.world_size == 1:
            raise
        error = e
    finally:  # a rank that could not plan still takes part, so that no rank waits for it: nothing is shared then
        if shared:
            regions = None if plan is None else {k: (r.nbytes, _cuts(r)) for k, r in plan.reads.items()}
            bands = planner.share_reads(ranks, regions)
    if plan is None:
        return None, error
    plan.bands = bands
    try:
        execute(storage, plan, readers, arena, ranks)
        return plan, None
    except (CorruptCheckpointError, StepNotFoundError) as e:
        return None, e
    except Exception as e:  # a read that failed otherwise (EIO, a storage error) on this rank: among ranks `agree`
        # tells every rank (raised here, this rank would skip the agreement and the others pair their next message
        # with it: one took the step with the bands this rank never read)
        if ranks.world_size == 1:
            raise
        return None, e


def shared_step(storage: Storage, step: int, ranks: Ranks) -> tuple[Manifest, StepFiles | None]:
    """The manifest of `step` of a root every rank reads, and the listing of its files (`layout.step_files`: None on a
    root without direct file IO), read by the leader alone and sent to the others in one message down a tree
    (`distributed.leader_reads`, collective: so is this), and the manifest checked by every rank as
    `layout.read_manifest` checks it (damage at the root or on the way is found, and named, on every rank alike). A
    manifest of R x T entries is then read once a restore, not R times (docs/benchmarks.md, `bench/manifest.py`), and
    the step's directory walked once, not R times (each walk a stat of every file: on a shared file system, R x files
    metadata calls). What the leader meets reaches every rank: a missing manifest as StepNotFoundError, one that is no
    regular file or a step holding a special file as its CorruptCheckpointError, any other error (a StorageError, a
    listing refused) as a CheckpointError naming rank 0, as `agree` names a rank that could not read."""

    def read() -> bytes:
        manifest = layout.read_manifest_bytes(storage, step)  # first: a step that is gone is StepNotFoundError
        files = step_files(storage, step)
        return _framed(manifest, None if files is None else files.sizes)

    data, sizes = _unframed(leader_reads(ranks, read, f"read step {step}", raw=True))
    manifest = layout.parse_manifest(storage, step, data)
    return manifest, None if sizes is None else StepFiles(where(storage, layout.step_dir(step)), sizes)


def _framed(manifest: bytes, sizes: dict[str, int] | None) -> bytes:
    """A manifest's bytes and its step's listing in one message: the manifest's length, the manifest, the listing
    as JSON (null: no listing)."""
    return len(manifest).to_bytes(8, "big") + manifest + json.dumps(sizes, separators=(",", ":")).encode()


def _unframed(message: bytes) -> tuple[bytes, dict[str, int] | None]:
    """The manifest's bytes and the listing `_framed` put in one message."""
    n = int.from_bytes(message[:8], "big")
    return message[8 : 8 + n], json.loads(message[8 + n :])


def agree(
    storage: Storage, ranks: Ranks, step: int, error: Exception | None
) -> CorruptCheckpointError | PartialCopyError | str | None:
    """Every rank's outcome of reading `step`, one decision for all: None (read everywhere), "vanished" (it was
    deleted meanwhile, e.g. by another process's retention: no damage), a `PartialCopyError` (a rank's own copy
    lacks what a rank needs: no damage either) or its damage. A rank whose state does not fit
    the step (a key, shape or dtype; a sampler over other data), or that could not read it for another reason than
    damage (`read_step`), makes every rank raise: that rank its own error, the others a StateMismatchError (a
    CheckpointError for the other reasons) naming it."""
    if error is None:
        verdict = "ok"
    elif isinstance(error, PartialCopyError):
        verdict = "partial"
    elif isinstance(error, (StateKeyError, StateMismatchError, DataMismatchError)):
        verdict = "mismatch"
    elif not isinstance(error, (CorruptCheckpointError, StepNotFoundError)):
        verdict = "refused"  # e.g. the manifest could not be read (StorageError)
    elif isinstance(error, StepNotFoundError):
        verdict = "vanished"
    else:
        try:
            verdict = "damaged" if layout.is_committed(storage, step) else "vanished"
        except Exception as e:  # the root does not answer whether it is damage: refused (raised here, this rank
            # would skip the message below and the others pair their next one with it)
            verdict, error = "refused", e
    told = None if error is None else str(error) if verdict in ("damaged", "vanished", "partial") else described(error)
    reports = ranks.all_gather_json([verdict, told])
    refused = [(r, v, m) for r, (v, m) in enumerate(reports) if v in ("mismatch", "refused")]
    if refused:
        if verdict in ("mismatch", "refused"):
            raise error
        rank, kind, message = refused[0]
        if kind == "mismatch":
            raise StateMismatchError(f"rank {rank} cannot restore step {step} into its state: {message}")
        raise CheckpointError(f"rank {rank} could not read step {step}: {message}")
    verdicts = [v for v, _ in reports]
    if "vanished" in verdicts:
        return "vanished"
    if "partial" in verdicts:
        if isinstance(error, PartialCopyError):
            return error
        rank, message = next((r, m) for r, (v, m) in enumerate(reports) if v == "partial")
        return PartialCopyError(f"rank {rank}: {message}")
    if "damaged" not in verdicts:
        return None
    if isinstance(error, CorruptCheckpointError):
        return error
    return CorruptCheckpointError(
        f"another rank found damage: {next(m for v, m in reports if v == 'damaged')}", step=step
    )
