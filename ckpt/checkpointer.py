"""Mechanism of one save and one restore: snapshot -> array writes -> commit, and manifest -> tensors.

The manager (policy) decides when and which; this module moves the bytes and never decides anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import tensorstore as ts
import torch

from . import state as state_mod
from . import store
from .errors import CorruptCheckpointError
from .format import ARRAYS, IN_PROGRESS, MANIFEST, ArrayInfo, Manifest, chunk_shape, dtype_name, step_dir, torch_dtype
from .distributed import Ranks, plan_arrays, read_region
from .lease import Lease
from .staging import Staged, StagingArena
from .storage import Storage

log = logging.getLogger("ckpt")


def versions() -> dict[str, str]:
    """Library versions recorded in every manifest, to explain a difference after an upgrade."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__, "numpy": np.__version__}
    for pkg in ("tensorstore", "ckpt-goodput"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


@dataclass
class WritePlan:
    """What one rank writes for a step: arrays it creates, the regions it writes, and the manifest parts."""

    step: int
    tree: Any
    arrays: dict[str, ArrayInfo]
    tensors: dict[str, torch.Tensor]  # name -> local tensor (the data of the box this rank writes)
    boxes: dict[str, tuple[tuple[int, int], ...]]  # name -> box of the global array this rank writes
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1


def plan(step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None, chunk_bytes: int,
         ranks: Ranks | None) -> WritePlan:
    """What this process writes for `step`: alone, every tensor is a whole array; among ranks, its slices."""
    flat = state_mod.flatten(state, rank=ranks.rank if ranks else 0)
    meta = _json_metadata(metadata)
    if ranks is None:
        arrays, boxes = {}, {}
        for name, t in flat.tensors.items():
            shape = tuple(t.shape)
            chunk = chunk_shape(shape, t.element_size(), ((0,) * len(shape),), chunk_bytes)
            arrays[name] = ArrayInfo(name, dtype_name(t.dtype, key=name), shape, chunk, (tuple((0, n) for n in shape),))
            boxes[name] = arrays[name].boxes[0]
        return WritePlan(step, flat.tree, arrays, flat.tensors, boxes, meta)
    arrays, writes, boxes = plan_arrays(ranks, flat.tensors, chunk_bytes)
    per_rank = {k: v["$per_rank"] for k, v in flat.tree.items() if isinstance(v, dict) and "$per_rank" in v}
    tree = flat.tree
    if per_rank:
        gathered = ranks.all_gather_json(per_rank)
        tree = dict(flat.tree)
        for k in per_rank:
            tree[k] = {"$per_rank": [entry for g in gathered for entry in g[k]]}
    return WritePlan(step, tree, arrays, writes, boxes, meta, world_size=ranks.world_size)


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(metadata or {})
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON (finite numbers, str, lists, dicts): {e}") from None
    return meta


class SaveJob:
    """One save in flight: the snapshot is taken in the constructor, `run()` writes and commits in the background."""

    def __init__(self, storage: Storage, plan: WritePlan, arena: StagingArena, context: ts.Context,
                 ranks: Ranks | None = None, lease: Lease | None = None):
        self.storage, self.plan, self.arena, self.context, self.ranks = storage, plan, arena, context, ranks
        self.lease = lease  # the root's lease (the leader's); None on other ranks
        self.leader = ranks is None or ranks.rank == 0
        self.dir = step_dir(plan.step)
        self._arrays: dict[str, ts.Future] | None = None
        self._prepared = False
        waves = arena.plan(plan.tensors)
        for wave in waves[:-1]:  # beyond the staging cap: write earlier waves before returning
            self._write_staged(arena.stage(plan.tensors, wave))
        self.staged = arena.stage(plan.tensors, waves[-1])

    def _prepare(self) -> None:
        """Once per save, before any array write: the leader clears leftovers and marks the save in flight."""
        if self._prepared:
            return
        self._prepared = True
        if self.leader:
            with self.lease.preparing() if self.lease else contextlib.nullcontext():  # gc waits meanwhile
                if self.storage.read(f"{self.dir}/{MANIFEST}") is not None:
                    raise FileExistsError(f"step {self.plan.step} is already committed in {self.storage.url}")
                self.storage.delete_tree(self.dir)  # leftovers of a crashed earlier attempt at this step
                marker = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                          "lease": self.lease.id if self.lease else None}
                self.storage.write_atomic(f"{self.dir}/{IN_PROGRESS}", json.dumps(marker).encode())
        if self.ranks is not None:
            self.ranks.barrier()

    def _open_arrays(self) -> dict[str, ts.Future]:
        """Start creating the arrays this rank writes (once); writes chain on each array as it opens."""
        if self._arrays is None:
            self._prepare()
            self._arrays = {name: store.create(self.storage.kvstore_spec(self._array_path(name)), info, self.context)
                            for name, info in self.plan.arrays.items() if name in self.plan.boxes}
        return self._arrays

    def _array_path(self, name: str) -> str:
        return f"{self.dir}/{ARRAYS}/{name}"

    def _write_staged(self, staged: Sequence[Staged]) -> None:
        arrays = self._open_arrays()
        futures = []
        for s in staged:
            info, box = self.plan.arrays[s.name], self.plan.boxes[s.name]
            if s.rows is not None:
                box = ((box[0][0] + s.rows[0], box[0][0] + s.rows[1]),) + box[1:]
            if any(b == a for a, b in box):
                continue
            futures.append(store.write(arrays[s.name].result(), box, store.typed(s.host, info.dtype, tuple(b - a for a, b in box))))
        for f in futures:
            f.result()  # resolves once the chunk is written and fsync'd (file kvstore's file_io_sync)

    def run(self) -> None:
        """Background part: write the last wave, wait until durable, then commit — once, for all ranks.

        Among ranks, every rank reports its outcome; the leader commits only if all succeeded, and
        every rank learns the result, so a failure anywhere leaves no committed step and reaches all.
        """
        error: BaseException | None = None
        try:
            self._write_staged(self.staged)
        except BaseException as e:
            error = e
        if self.ranks is None:
            if error is not None:
                raise error
            self.commit()
            return
        rank = self.ranks.rank
        failures = [f for f in self.ranks.all_gather_json(None if error is None else f"rank {rank}: {type(error).__name__}: {error}") if f]
        commit_error = None
        if not failures and self.leader:
            try:
                self.commit()
            except Exception as e:
                commit_error = f"rank 0 could not commit: {type(e).__name__}: {e}"
        verdict = self.ranks.all_gather_json(commit_error)[0]
        if error is not None:
            raise error
        if failures or verdict:
            raise RuntimeError("; ".join(failures) or verdict)

    def manifest(self) -> Manifest:
        p = self.plan
        return Manifest(step=p.step, tree=p.tree, arrays=p.arrays, metadata=p.metadata, time=time.time(),
                        world_size=p.world_size, versions=versions())

    def abandon(self) -> None:
        """After a failed write: remove what this save left, unless it got as far as committing."""
        if self.leader and self._prepared and self.storage.read(f"{self.dir}/{MANIFEST}") is None:
            self.storage.delete_tree(self.dir)

    def commit(self) -> None:
        """Make every directory entry durable, then write the manifest last (atomically): from now on the step exists."""
        self.storage.sync_tree(self.dir)
        if self.lease:
            self.lease.check()  # a writer that lost the root's lease never commits
        self.storage.write_atomic(f"{self.dir}/{MANIFEST}", self.manifest().to_bytes())
        self.storage.delete_file(f"{self.dir}/{IN_PROGRESS}")


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of a committed step; FileNotFoundError when the step is not committed."""
    path = f"{step_dir(step)}/{MANIFEST}"
    data = storage.read(path)
    if data is None:
        raise FileNotFoundError(f"step {step} is not committed in {storage.url} (no {path})")
    m = Manifest.from_bytes(data, file=_where(storage, path))
    if m.step != step:
        raise CorruptCheckpointError(f"manifest says step {m.step}", step=step, file=_where(storage, path))
    return m


def _where(storage: Storage, path: str) -> str:
    return storage.local_path(path) or f"{storage.url}{path}"


@dataclass
class _Read:
    info: ArrayInfo
    dest: torch.Tensor
    box: tuple[tuple[int, int], ...]
    after: list[torch.Tensor] = field(default_factory=list)  # other tensors to receive the same data


def restore_into(storage: Storage, manifest: Manifest, target: dict[str, Any], keys: Sequence[str] | None,
                 context: ts.Context, pool: ThreadPoolExecutor, *, rank: int = 0, world_size: int = 1,
                 rank_map: str = "modulo") -> list[int]:
    """Load the selected keys of a manifest into `target` in place; nothing is applied unless every read verified.

    DTensor targets read only their own shard's region of each global array (any world size); other
    tensors read whole arrays. Per-rank entries follow `select_rank`. Returns the byte sizes of the tensors read.
    """
    tree = manifest.tree
    if not isinstance(tree, dict):
        raise CorruptCheckpointError("manifest tree is not a dict", step=manifest.step)
    selected = list(keys) if keys is not None else list(target.keys())
    missing = [k for k in selected if k not in tree]
    if missing:
        raise KeyError(f"keys {missing} not in checkpoint step {manifest.step} (it has {sorted(tree)})")
    absent = [k for k in selected if k not in target]
    if absent:
        raise KeyError(f"keys {absent} are not in the state passed to restore (it has {sorted(target)})")
    nodes = {}
    for k in selected:
        node = tree[k]
        if isinstance(node, dict) and "$per_rank" in node:
            node = state_mod.select_rank(node, rank, manifest.world_size, world_size, rank_map)
            if node is None:
                continue
        nodes[k] = node
    reads: dict[str, _Read] = {}
    post: list[tuple[torch.Tensor, torch.Tensor]] = []

    def load(name: str, template: Any) -> Any:
        info = manifest.arrays.get(name)
        if info is None:
            raise CorruptCheckpointError("tree refers to an array the manifest does not list", step=manifest.step, key=name)
        tmpl = torch.from_numpy(template) if isinstance(template, np.ndarray) and template.flags.writeable else template
        shard = read_region(info, tmpl)
        if shard is not None:
            dtensor, box = shard
            _check_match(info, dtensor, manifest.step)
            reads.setdefault(name, _Read(info, _contiguous_dest(dtensor.to_local(), box, info, post), box))
            return dtensor
        whole = tuple((0, n) for n in info.shape)
        if isinstance(tmpl, torch.Tensor):
            _check_match(info, tmpl, manifest.step)
        if name in reads:
            r = reads[name]
            if isinstance(tmpl, torch.Tensor) and tmpl.data_ptr() != r.dest.data_ptr():
                r.after.append(tmpl)
                return tmpl
            return r.dest
        if isinstance(tmpl, torch.Tensor):
            dest = _contiguous_dest(tmpl, whole, info, post)
            reads[name] = _Read(info, dest, whole)
            return tmpl
        dest = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        reads[name] = _Read(info, dest, whole)
        return dest

    values = {k: state_mod.decode(node, load, target[k], k) for k, node in nodes.items()}
    _run_reads(storage, manifest, reads, context, pool)
    for r in reads.values():
        for t in r.after:
            t.copy_(r.dest)
    for dst, src in post:
        dst.copy_(src)
    for k in values:
        state_mod.apply(target, k, values[k])
    return [r.dest.numel() * r.dest.element_size() for r in reads.values()]


def _check_match(info: ArrayInfo, tmpl: torch.Tensor, step: int) -> None:
    if tuple(tmpl.shape) != info.shape:
        raise ValueError(f"restore of key {info.name!r} (step {step}): checkpoint has shape {list(info.shape)}, "
                         f"the target tensor has shape {list(tmpl.shape)}")
    if tmpl.dtype != torch_dtype(info.dtype):
        raise ValueError(f"restore of key {info.name!r} (step {step}): checkpoint has dtype {info.dtype}, "
                         f"the target tensor has dtype {str(tmpl.dtype).removeprefix('torch.')}")


def _contiguous_dest(tmpl: torch.Tensor, box: tuple[tuple[int, int], ...], info: ArrayInfo,
                     post: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Read straight into the caller's tensor when it is contiguous CPU memory, else via a temporary."""
    if tmpl.device.type == "cpu" and tmpl.is_contiguous():
        return tmpl
    tmp = torch.empty(tuple(b - a for a, b in box), dtype=torch_dtype(info.dtype),
                      pin_memory=tmpl.device.type == "cuda")
    post.append((tmpl, tmp))
    return tmp


def _run_reads(storage: Storage, manifest: Manifest, reads: Mapping[str, _Read], context: ts.Context,
               pool: ThreadPoolExecutor) -> None:
    base = step_dir(manifest.step)
    direct, futures = [], []
    for name, r in reads.items():
        path = f"{base}/{ARRAYS}/{name}"
        local = storage.local_path(path)
        rows = store.direct_rows(r.info, r.box) if local is not None else None
        if rows is not None:
            direct.extend(store.read_direct(local, r.info, r.dest, rows, pool, step=manifest.step))
        elif r.dest.numel():
            futures.append(pool.submit(store.read_into, storage.kvstore_spec(path), r.info, r.dest, r.box, context,
                                       step=manifest.step, file_hint=_where(storage, path)))
    errors = []
    for f in direct + futures:
        try:
            f.result()
        except Exception as e:  # keep reading so the first damaged key is reported, not a random one
            errors.append(e)
    if errors:
        raise errors[0]

