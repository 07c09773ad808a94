"""Mechanism of one save: plan -> snapshot -> array writes (and chunk digests) -> commit.

The manager (policy) decides when and which; this module moves the bytes and never decides anything.
Its mirror for restores is `restore.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import tensorstore as ts
import torch

from . import layout, store
from . import state as state_mod
from .chunk_files import ChunkWriter
from .distributed import Ranks
from .errors import CheckpointWriteError, CollectiveTimeout, LeaseHeldError, StepExistsError, StorageError, described
from .format import MAX_DEPTH, ArrayInfo, Manifest, deeper_than
from .lease import Lease
from .packs import PackWriter
from .planner import ArrayPlan, Planner
from .snapshot import Pending, Watched
from .staging import Staged, StagingArena
from .storage import Storage, request_error

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
    # the manifest's tree: with every rank's entries on whoever commits (the leader, or each rank of a private root)
    tree: Any
    arrays: dict[str, ArrayInfo]  # every array on whoever commits; elsewhere the ones this rank writes
    tensors: dict[str, torch.Tensor]  # name -> local tensor (the data of the box this rank writes)
    boxes: dict[str, tuple[tuple[int, int], ...]]  # name -> box of the global array this rank writes
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    private: bool = False  # each rank writes into a root of its own (the local tier), every box it holds
    designated: frozenset[str] = frozenset()  # arrays whose box this rank alone writes to a shared root
    packs: dict[str, ArrayInfo] = field(default_factory=dict)  # the pack arrays, as `arrays` (see `planner.py`)
    rank: int = 0
    durable: ArrayPlan | None = None  # private: this rank's part of the shared root's plan, which a persist follows
    held: Mapping[str, int] | None = None  # private: the box this rank holds of each array (`Manifest.held`)

    @property
    def pack(self) -> ArrayInfo | None:
        """The pack array this rank writes, if it packs any tensor."""
        return self.packs.get(layout.pack_name(self.rank))


def plan(
    step: int,
    state: Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    chunk_bytes: int,
    ranks: Ranks,
    planner: Planner,
    pack_bytes: int = 0,
    *,
    private: bool = False,
    failure: Exception | None = None,
    persist: bool | None = None,
) -> WritePlan:
    """What this process writes for `step`: alone, every tensor is a whole array; among ranks, its slices (agreed,
    or reused, by `planner`). The boxes it places in its pack come first, in the order of their places (its pack is
    written as one stream), then the others.

    `private`: each rank writes into a root of its own (the local tier), so it writes every box it holds and
    commits its own copy of the manifest; the root then holds what this rank needs to restore at this topology.

    `persist`: the save's `persist=` (every rank must pass the same, as the same step). `failure`: this rank
    cannot save (raised before, e.g. an earlier write's error). Among ranks, a rank that cannot
    save (that, or a state or metadata it cannot write) still takes part in the plan's first message, so that every
    rank raises and none waits for it or pairs this save with its next one; it raises its own error.
    """
    try:
        if failure is not None:
            raise failure
        flat = state_mod.flatten(state, rank=ranks.rank)
        meta = _json_metadata(metadata)
    except Exception as e:
        if ranks.world_size == 1:
            raise
        with contextlib.suppress(CheckpointWriteError):  # every rank raises; this one its own error
            planner.plan(
                ranks,
                {},
                chunk_bytes,
                pack_bytes,
                every_holder=private,
                step=step,
                failure=described(e),
                persist=persist,
            )
        raise e
    agreed, writes, boxes = planner.plan(
        ranks,
        flat.tensors,
        chunk_bytes,
        pack_bytes,
        every_holder=private,
        step=step,
        persist=persist,
        skeleton=state_mod.save_skeleton(flat) if ranks.world_size > 1 else None,
    )
    per_rank = state_mod.per_rank_entries(flat.tree)
    tree = flat.tree
    if per_rank or ranks.world_size > 1:  # every rank's entries, side by side in the manifest, to whoever commits it
        # (among ranks always: a rank whose state has them where another's has not must not leave it waiting)
        gathered = ranks.all_gather_json(per_rank) if private else ranks.gather_json(per_rank)
        tree = dict(flat.tree)
        for k in dict.fromkeys(k for g in gathered or () for k in g):
            tree[k] = state_mod.per_rank_node([entry for g in gathered for entry in g.get(k, [])])
    placed = {n: _place(agreed.arrays[n], b) for n, b in boxes.items() if agreed.arrays[n].places}
    writes = {n: writes[n] for n in sorted(placed, key=placed.get)} | writes
    return WritePlan(
        step,
        tree,
        agreed.arrays,
        writes,
        boxes,
        meta,
        ranks.world_size,
        private,
        agreed.designated,
        agreed.packs,
        ranks.rank,
        agreed.durable,
        agreed.held,
    )


def _place(info: ArrayInfo, box: tuple[tuple[int, int], ...]) -> int:
    """Where a box this rank writes is placed in its pack (an empty box: nowhere, first)."""
    return info.places[info.boxes.index(box)][1] if box in info.boxes else -1


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """User metadata as JSON; a 0-d tensor (``loss``) or numpy scalar is stored as its Python number."""

    def number(x: Any) -> Any:
        if isinstance(x, (torch.Tensor, np.ndarray, np.generic)) and x.ndim == 0:
            return x.item()
        raise TypeError(f"{type(x).__qualname__} is not JSON")

    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict with str keys, e.g. {{'loss': 0.5}}, got {type(metadata).__name__}")
    out = {}
    for key, value in dict(metadata or {}).items():
        if not isinstance(key, str):  # JSON writes 1 as "1": it came back under another key, or took "1"'s place
            raise TypeError(f"metadata keys must be str (JSON object keys), got {key!r} ({type(key).__name__})")
        try:  # NaN and inf are kept (a diverged loss): the manifest writes them as the state tree does
            out |= json.loads(json.dumps({key: value}, default=number))
        except (TypeError, ValueError, RecursionError) as e:
            raise TypeError(
                f"metadata[{key!r}] must be JSON (numbers, str, bool, None, lists, dicts; 0-d tensors and numpy "
                f"scalars become numbers): {described(e)}"
            ) from None
        if deeper_than(out[key], MAX_DEPTH - 1):
            raise TypeError(f"metadata[{key!r}] is nested deeper than {MAX_DEPTH} levels")
        _check_keys(value, f"metadata[{key!r}]")
    return out


def _check_keys(value: Any, where: str) -> None:
    """TypeError naming its path unless every dict in metadata `value` (JSON-able, so no cycles) has str keys: JSON
    writes 1, True or None as "1", "true", "null", so the key came back as another and a twin's value was lost."""
    stack = [(value, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{path} has a key {k!r} ({type(k).__name__}): metadata keys must be str (JSON object keys)"
                    )
                stack.append((x, f"{path}[{k!r}]"))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))


class SaveJob:
    """One save in flight: the snapshot is taken in the constructor, `run()` writes and commits in the background.

    `defer`: tensors whose copy may be made after the constructor returns (name -> version counters now; see
    `ckpt.snapshot`): they are left to `pending`, which the caller runs, and `run()` waits for it before writing.
    Only when the whole snapshot fits the arena at once; past the staging cap every copy is made here.
    """

    def __init__(
        self,
        storage: Storage,
        plan: WritePlan,
        arena: StagingArena,
        context: ts.Context,
        ranks: Ranks,
        lease: Lease | None = None,
        fsyncs: ThreadPoolExecutor | None = None,
        defer: Mapping[str, Watched] | None = None,
    ):
        self.storage, self.plan, self.arena, self.context, self.ranks = storage, plan, arena, context, ranks
        self.lease = lease  # the root's lease (the leader's, or each rank's own root's); None on other ranks
        self.leader = ranks.leader or plan.private  # who prepares and commits the root
        self.dir = layout.step_dir(plan.step)
        # this save's data directory inside the step (rank 0's for every rank; see `_prepare`)
        self.data = layout.new_data_dir()
        self.digests = store.ChunkDigests()  # of arrays' chunks (those of placed boxes: `self._pack.digests`)
        self._pack: PackWriter | None = None  # this rank's pack, opened with its arrays
        self._reference = not storage.keeps_written_buffers  # see store.write
        # row-chunked arrays of a root with direct file IO (a local one): their chunk files written by this thread
        # (fsync'd on `fsyncs`), not by tensorstore's pool
        self._files = ChunkWriter(fsyncs) if fsyncs is not None and storage.direct_path("") is not None else None
        self._arrays: dict[str, ts.Future] | None = None
        self._prepared = False
        self._in_doubt = False  # the manifest's write failed in a way the store may still apply (`ManifestInDoubt`)
        self.pending: Pending | None = None
        self.staged: Sequence[Staged] = []
        # among ranks, a snapshot that failed on this rank (an allocation, a copy): the other ranks go on with the
        # save the plan agreed, so this one takes part in its messages in `run()` and reports this error there
        self.failure: Exception | None = None
        try:
            waves = arena.plan(plan.tensors)
            for wave in waves[:-1]:  # beyond the staging cap: write earlier waves before returning
                self._write_staged(arena.stage(plan.tensors, wave)[0])
            defer = dict(defer or {}) if len(waves) == 1 else {}
            self.staged, later = arena.stage(plan.tensors, waves[-1], later=defer)
            self.pending = Pending(plan.step, later, plan.tensors, defer) if defer else None
        except Exception as e:
            if ranks.world_size > 1 and not isinstance(e, CollectiveTimeout):
                self.failure, self.staged, self.pending = e, [], None
                return
            with contextlib.suppress(Exception):  # raised from save() itself: what it opened and wrote goes with it
                self.abandon()
            raise
        except BaseException:  # Ctrl-C: raised from save() itself, as above
            with contextlib.suppress(Exception):
                self.abandon()
            raise

    def _prepare(self, failure: BaseException | None = None) -> None:
        """Once per save, before any array write: the leader clears leftovers and marks the save in flight. Among
        ranks a collective (the step's data directory from rank 0), in which every rank takes part once: also one
        whose save already failed (`failure`: it begins nothing). When rank 0 could not begin the step, or failed
        before, it tells the others, which then write nothing."""
        if self._prepared:
            return
        self._prepared = True
        if self.leader and failure is None:
            try:
                begin_step(self.storage, self.plan.step, self.lease)
            except Exception as e:  # told to the others in the broadcast below, then raised
                failure = e
        # rank 0's data directory for every rank (also with private roots: a persist copies every rank's regions under
        # the one manifest's name); also the barrier: no rank writes before the step is begun
        told = None if failure is None or not self.ranks.leader else described(failure)
        self.data, told = self.ranks.broadcast_json([self.data, told])
        if failure is not None:
            raise failure
        if told is not None:
            raise RuntimeError(f"rank 0 could not begin writing step {self.plan.step}: {told}")

    def _array_path(self, info: ArrayInfo) -> str:
        """Where an array of this step lives in the root: a pack, or an array of its own, in this save's directory."""
        at = layout.pack_path if info.name in self.plan.packs else layout.array_path
        return at(self.plan.step, info.name, self.data)

    def _open_arrays(self) -> dict[str, ts.Future]:
        """Start creating the arrays this rank writes (once), its pack among them; writes chain on each as it opens."""
        if self._arrays is None:
            self._prepare()
            spec = self.storage.kvstore_spec
            mine = [info for name, info in self.plan.arrays.items() if name in self.plan.boxes and not info.places]
            pack = self.plan.pack
            self._arrays = {
                info.name: store.create(spec(self._array_path(info)), info, self.context)
                for info in mine + ([pack] if pack is not None else [])
            }
            if pack is not None:
                local = self.storage.direct_path(self._array_path(pack)) if self._files is not None else None
                opened = self._arrays[pack.name]
                self._pack = PackWriter(
                    pack, local or "", self._files if local else None, opened.result, reference=self._reference
                )
        return self._arrays

    def _write_staged(self, staged: Sequence[Staged], last: bool = False) -> None:
        """Write staged pieces and, while tensorstore writes them, compute their chunks' digests. Placed boxes
        stream into this rank's pack (its last chunk closed with the `last` wave) on this thread, after the
        writes of the others were handed to tensorstore."""
        arrays = self._open_arrays()
        futures, pieces, direct, placed = [], [], [], []
        for s in staged:
            info, box = self.plan.arrays[s.name], self.plan.boxes[s.name]
            if s.rows is not None:
                box = ((box[0][0] + s.rows[0], box[0][0] + s.rows[1]),) + box[1:]
            if any(b == a for a, b in box):
                continue
            if info.places:
                whole = self.plan.boxes[s.name]
                row = info.box_nbytes(whole) // max(1, whole[0][1] - whole[0][0]) if whole else 0
                placed.append((info, info.boxes.index(whole), (s.rows[0] * row) if s.rows else 0, s.host))
                continue
            data = store.typed(s.host, info.dtype, tuple(b - a for a, b in box))
            if self._files is not None and store.direct_rows(info, self.plan.boxes[s.name]) is not None:
                direct.append((info, box, data, self.digests))
                continue
            futures.append(store.write(arrays[s.name].result(), box, data, reference=self._reference))
            pieces.append((info, box, data))
        try:
            for info, box, data, digests in direct:  # while tensorstore writes the others
                path = self.storage.direct_path(self._array_path(info))
                done = self._files.write(path, info, box[0] if box else (0, 1), data)
                digests.done.setdefault(info.name, {}).update(done)
            for info, box, data in pieces:
                self.digests.add(info, box, data)
            if self._pack is not None:
                for info, i, offset, host in sorted(placed, key=lambda p: p[0].places[p[1]][1] + p[2]):
                    self._pack.feed(info, i, offset, memoryview(host))
                if last:
                    self._pack.finish()
                futures += self._pack.futures  # buffered chunks: their own memory, but waited for like the rest
                self._pack.futures = []
        finally:  # never leave writes that reference the arena behind: wait for each, then raise the first error
            settle(futures)  # each resolves once its chunk is written and fsync'd (file kvstore's file_io_sync)

    def run(self) -> None:
        """Background part: write the last wave, wait until durable, then commit — once, for all ranks.

        Among ranks, every rank reports its outcome and the digests of the chunks it wrote; the leader
        commits only if all succeeded, and every rank learns the result, so a failure anywhere leaves no
        committed step and reaches all. A rank raises its own error (the leader its commit's), else the others'.
        """
        error: BaseException | None = None
        try:
            if self.failure is not None:
                raise self.failure
            if self.pending is not None:
                self.pending.result()  # the copies overlapped with training, unchanged meanwhile
            self._write_staged(self.staged, last=True)
            settle(list(self._open_arrays().values()))  # zarr.json of the arrays whose chunks were written directly
            if self._files is not None:
                self._files.close()  # every chunk file written here is durable
        except BaseException as e:
            error = request_error(self.storage, e)  # a chunk's write to an object store names its URL and endpoint
        if error is not None and not self._prepared and self.ranks.world_size > 1:
            try:  # failed before the step's first message: take part in it, so that no rank waits for this one
                self._prepare(error)
            except CollectiveTimeout as e:
                error = e
            except BaseException:  # its own error, raised again: the one this rank reports
                pass
        rank = self.ranks.rank
        report = {
            "error": None if error is None else f"rank {rank}: {described(error)}",
            "digests": {name: list(d.items()) for name, d in self.digests.done.items()},
        }
        if self._pack is not None:
            report["digests"] |= {name: list(d.items()) for name, d in self._pack.digests.items()}
        # to whoever commits: the leader, or every rank of a private root (its manifest has every rank's digests)
        reports = self.ranks.all_gather_json(report) if self.plan.private else self.ranks.gather_json(report)
        failures = [r["error"] for r in reports or () if r["error"]]
        commit_error: Exception | None = None
        if reports is not None and not failures and self.leader:
            digests: dict[str, dict[int, int]] = {}
            for r in reports:
                for name, pairs in r["digests"].items():
                    digests.setdefault(name, {}).update((int(i), int(c)) for i, c in pairs)
            try:
                self.commit(digests)
            except Exception as e:
                commit_error, self._in_doubt = e, isinstance(e, ManifestInDoubt)
        try:
            raise_outcome(self.ranks, error, commit_error, failures, each_commits=self.plan.private)
        except CollectiveTimeout as e:  # a rank went away before all heard the verdict: the step may be committed
            e.committed = error is None and commit_error is None and layout.is_committed(self.storage, self.plan.step)
            raise

    def manifest(self, digests: Mapping[str, Mapping[int, int]]) -> Manifest:
        """The manifest of this save: every array with the digest of each of its chunks, or of each of its boxes
        where they are placed in packs (from all ranks); the packs, raw bytes, have none of their own."""
        p = self.plan

        def summed(infos: Mapping[str, ArrayInfo]) -> dict[str, ArrayInfo]:
            out = {}
            for name, info in infos.items():
                unit = "segments" if info.places else "chunks"
                count = info.digest_count
                sums = [digests.get(name, {}).get(i) for i in range(count)]
                if None in sums:
                    raise RuntimeError(
                        f"array {name!r}: digests of {sums.count(None)} of its {len(sums)} {unit} were not computed"
                    )
                out[name] = dataclasses.replace(info, digests=tuple(sums))
            return out

        return Manifest(
            step=p.step,
            tree=p.tree,
            arrays=summed(p.arrays),
            metadata=p.metadata,
            time=time.time(),
            world_size=p.world_size,
            versions=versions(),
            packs={name: dataclasses.replace(pack, digests=()) for name, pack in p.packs.items()},
            data=self.data,
            held=None if p.held is None or p.world_size == 1 else dict(p.held),  # alone, a rank holds every box
        )

    def abandon(self) -> None:
        """After a failed write: remove what this save left, unless it got as far as committing (the step committed by
        another save, this one's data directory only)."""
        if self.pending is not None:  # deferred copies still writing into the arena, which the next save reuses
            self.pending.wait()
        with contextlib.suppress(Exception):  # arrays still being created would write their files after the delete
            settle(list((self._arrays or {}).values()))
        if self._pack is not None:
            self._pack.close()
        if self._files is not None:
            with contextlib.suppress(Exception):  # as would fsyncs in flight
                self._files.close()
        if not (self.leader and self._prepared):
            return
        if not layout.is_committed(self.storage, self.plan.step):
            clear_attempt(self.storage, self.plan.step, self.data, self.lease, in_doubt=self._in_doubt)
        elif layout.read_manifest(self.storage, self.plan.step).data != self.data:
            self.storage.delete_tree(layout.data_path(self.plan.step, self.data))

    def commit(self, digests: Mapping[str, Mapping[int, int]]) -> None:
        """Make every directory entry durable, then write the manifest last (atomically): from now on the step exists."""
        commit_step(self.storage, self.plan.step, self.manifest(digests).to_bytes(), self.lease)


def settle(futures: Sequence[ts.Future]) -> None:
    """Wait for every future, then raise the first one's error, if any: none is left running behind an error."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def raise_outcome(
    ranks: Ranks,
    error: BaseException | None,
    commit_error: BaseException | None,
    failures: list,
    *,
    each_commits: bool = False,
) -> None:
    """After a commit among ranks: every rank learns whether any write or commit failed; a rank raises its own error
    (its write's, then its commit's), else the others', else nothing. `failures`: the ranks' write errors, as the
    committer saw them. The leader commits for all and tells them; with `each_commits` (private roots) every rank
    committed its own and all tell all."""
    mine = None if commit_error is None else f"rank {ranks.rank} could not commit: {described(commit_error)}"
    if each_commits:
        verdict = next((v for v in ranks.all_gather_json(mine) if v), None)
    else:
        told = ranks.broadcast_json({"failures": failures, "commit": mine})
        failures, verdict = told["failures"], told["commit"]
    if error is not None:
        raise error
    if commit_error is not None:
        raise commit_error
    if failures or verdict:
        raise RuntimeError("; ".join(failures) or verdict)


def begin_step(storage: Storage, step: int, lease: Lease | None) -> None:
    """Start writing a step into a root (its writer only): clear leftovers of a crashed attempt, mark it in progress.

    Under the lease's `preparing()`, so that gc never deletes a save it did not see start. Where a writer that lost
    the lease may still be writing (object stores), its data directory is left to gc: this save writes its own.
    """
    with lease.preparing() if lease else contextlib.nullcontext():
        if lease:
            lease.check()  # a writer that lost the root clears nothing
        layout.check_step_free(storage, step)
        if layout.is_committed(storage, step):
            raise StepExistsError(f"step {step} is already committed in {storage.url}")
        if lease is None or lease.exclusive:
            storage.delete_tree(layout.step_dir(step))
        marker = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "lease": lease.id if lease else None,
        }
        storage.write_atomic(layout.in_progress_path(step), json.dumps(marker).encode())


class ManifestInDoubt(StorageError):
    """The manifest's write failed in a way the store may still apply (no answer in time, a lost connection): the step
    may yet become committed, with this save's data."""


def clear_attempt(
    storage: Storage, step: int, data: str | None, lease: Lease | None, *, in_doubt: bool = False
) -> None:
    """Remove what a failed save of `step` wrote: the whole step directory where no other writer can be writing it
    (this one still holds an exclusive lease), else only this save's data directory (`data`; None: not known, left to
    gc) and its marker. `in_doubt` (its manifest's write may still land, `ManifestInDoubt`): nothing, so that a step
    committed late finds its data; gc removes it if it never commits."""
    if in_doubt:
        log.warning(
            "step %d: its manifest's write may still land, so this save's files stay for it (`ckpt gc` removes them "
            "if the step never commits)",
            step,
        )
        return
    if lease is None or (lease.exclusive and _holds(lease)):
        storage.delete_tree(layout.step_dir(step))
        return
    if data:
        storage.delete_tree(layout.data_path(step, data))
    storage.delete_file(layout.in_progress_path(step))


def _holds(lease: Lease) -> bool:
    try:
        lease.check()
        return True
    except LeaseHeldError:
        return False


def commit_step(storage: Storage, step: int, manifest: bytes, lease: Lease | None) -> None:
    """Make every directory entry of the step durable, check the lease, then create the manifest last: atomically,
    and only if the step has none, so a committed step is never overwritten, by anyone.

    The manifest's write must end within the time the lease check leaves (its expiry less a margin): a writer that
    stalls in between fails instead of committing after another writer took the root over. Should it commit late
    anyway (a pause the bound cannot see), its manifest names its own data directory, never its successor's files.
    """
    storage.sync_tree(layout.step_dir(step))
    left = lease.check() if lease else math.inf  # a writer that lost the root's lease never commits
    try:
        storage.create(layout.manifest_path(step), manifest, timeout=None if math.isinf(left) else left)
    except StorageError as e:
        cut = "" if math.isinf(left) else f" was cut at the lease's deadline ({left:.1f} s after its check)"
        raise ManifestInDoubt(
            f"{e}; the manifest's write{cut} failed: should the store still apply it, step {step} becomes committed "
            f"with this save's data, which stays for it (`ckpt ls` tells)",
            url=e.url,
            endpoint=e.endpoint,
            bucket=e.bucket,
            key=e.key,
        ) from e
    except FileExistsError:
        raise StepExistsError(
            f"step {step} was committed in {storage.url} by another writer while this save wrote it (did this writer "
            f"lose the root's lease?); that step is left as it is, and nothing of this save is committed"
        ) from None
    try:  # committed now: a marker left behind (a store that went away this instant) is harmless, never read
        storage.delete_file(layout.in_progress_path(step))
    except Exception as e:
        log.warning("step %d is committed, but its %s marker could not be removed: %s", step, layout.IN_PROGRESS, e)
