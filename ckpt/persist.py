"""Mechanism of a persist: a step committed in the local tier copied to the durable root, verified, manifest last.

No second snapshot from training memory: the bytes come from the local tier's committed files. Every byte is
checked on the way (each chunk's size, crc32c and digest, each zarr.json against the manifest; each placed box
segment by segment against its digest), so a damaged local copy never becomes a durable checkpoint. Among ranks each
copies the regions it is the designated writer of (replicated tensors once): its placed boxes, which its local pack
holds beside replicas, laid out anew in its pack of the shared root (`relay_pack`), its other arrays' chunk files as
they are. The leader commits for all, exactly as a save does, the local manifest with the shared places. The manager
(policy, through `tiers.py`) decides which steps and when.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

from . import layout, store
from .chunk_files import ChunkWriter
from .distributed import Box, Ranks
from .errors import CorruptCheckpointError, described
from .format import Manifest, chunk_key, zarr_mismatch
from .lease import Lease
from .packs import BoxRead, PackWriter, read_boxes
from .planner import ArrayPlan
from .pools import Inline, submit_or_run
from .save import ManifestInDoubt, begin_step, clear_attempt, commit_step, raise_outcome, settle
from .storage import Storage, context, request_error, where

log = logging.getLogger("ckpt")


def copy_region(
    src: Storage, dst: Storage, step: int, manifest: Manifest, name: str, box: Box, files: ChunkWriter | None = None
) -> int:
    """Copy one region of an array (its zarr.json and every chunk it touches) from `src` to `dst`, each file
    checked before it is written; returns the bytes copied. `files`: writes the chunk files of a `dst` with direct
    file IO (O_DIRECT, fsync'd by its threads: durable once it is closed); else each is written atomically."""
    info = manifest.arrays[name]
    path = layout.array_path(step, name, manifest.data)
    meta = src.read(f"{path}/zarr.json")
    problem = "is missing" if meta is None else zarr_mismatch(meta, info)
    if problem:
        raise CorruptCheckpointError(f"zarr.json {problem}", step=step, key=name, file=where(src, f"{path}/zarr.json"))
    dst.write_atomic(f"{path}/zarr.json", meta)
    copied = len(meta)
    for index in info.chunks(box):
        data = store.read_chunk_file(src, path, info, index, step=step)
        if files is not None:
            files.copy(dst.direct_path(f"{path}/{chunk_key(index)}"), data)
        else:
            dst.write_atomic(f"{path}/{chunk_key(index)}", data)
        copied += len(data)
    return copied


def relay_pack(
    src: Storage,
    dst: Storage,
    step: int,
    manifest: Manifest,
    shared: ArrayPlan,
    pack: str,
    boxes: Mapping[str, Box],
    files: ChunkWriter | None,
    pool: ThreadPoolExecutor,
    ahead: int,
) -> int:
    """Write pack `pack` of the shared root from the placed `boxes` (array -> box) of the local step of `manifest`:
    each box read segment by segment from the local pack (up to `ahead` segments at once on `pool`), checked against
    the manifest's digest, and fed at its shared place. Returns the bytes of the boxes. `files`: as `copy_region`."""
    info = shared.packs.get(pack)
    if info is None:
        return 0
    order = []
    for name, box in boxes.items():
        i = shared.arrays[name].boxes.index(box)
        order.append((shared.arrays[name].places[i][1], name, i))
    path = layout.pack_path(step, pack, manifest.data)
    opened = store.create(dst.kvstore_spec(path), info, context())
    local = dst.direct_path(path) if files is not None else None
    writer = PackWriter(info, local or "", files if local else None, opened.result, reference=False)

    def read(name: str, i: int, lo: int, hi: int) -> memoryview:
        dest = memoryview(bytearray(hi - lo))
        path_of = lambda p: layout.pack_path(step, p, manifest.data)  # noqa: E731
        for f in read_boxes(
            src, manifest.packs, path_of, [BoxRead(manifest.arrays[name], i, lo, hi, dest)], Inline(), step=step
        ):
            f.result()
        return dest

    segments = [(name, i, lo, hi) for _, name, i in sorted(order) for lo, hi, _ in manifest.arrays[name].segments(i)]
    reads: collections.deque = collections.deque()
    fed = 0
    try:
        for k, (name, i, lo, hi) in enumerate(segments):
            while len(reads) < ahead and k + len(reads) < len(segments):
                reads.append(submit_or_run(pool, read, *segments[k + len(reads)]))
            writer.feed(shared.arrays[name], i, lo, reads.popleft().result())
            fed += hi - lo
        writer.finish()
        settle(writer.futures + [opened])
    except BaseException:
        writer.close()
        for f in reads:
            f.cancel()
        with contextlib.suppress(Exception):  # the pack still being created would write its files after the cleanup
            settle(writer.futures + [opened])
        raise
    for name, sums in writer.digests.items():  # the bytes written are the bytes checked
        expected = manifest.arrays[name].digests
        for index, value in sums.items():
            if value != expected[index]:
                raise CorruptCheckpointError(
                    f"placed tensor changed while persisted: segment {index} crc32c {value:08x}, the manifest "
                    f"expects {expected[index]:08x}",
                    step=step,
                    key=name,
                    file=where(src, layout.pack_path(step, pack, manifest.data)),
                )
    return fed


def durable_manifest(local: Manifest, shared: ArrayPlan) -> Manifest:
    """The shared root's manifest of a step persisted from a local tier: the local one, digests and all, with every
    placed box at its place in the shared packs (a shared root holds every box: no `held`)."""
    arrays = {}
    for name, info in local.arrays.items():
        places = shared.arrays[name].places if name in shared.arrays else None
        if (info.places is None) != (places is None):
            raise RuntimeError(f"array {name!r}: the local step and the plan of the shared root place it differently")
        arrays[name] = info if places is None else dataclasses.replace(info, places=places)
    packs = {name: dataclasses.replace(p, digests=()) for name, p in shared.packs.items()}
    return dataclasses.replace(local, arrays=arrays, packs=packs, held=None)


class PersistJob:
    """One persist of `step` from `src` (this rank's local tier) to `dst` (the durable root), run on every rank:
    `regions`, the box of each array this rank is the designated writer of, laid out as `shared` (the rank's part of
    the shared root's plan of the step, `ArrayPlan.durable`) says."""

    def __init__(
        self,
        src: Storage,
        dst: Storage,
        step: int,
        regions: Mapping[str, Box],
        shared: ArrayPlan,
        ranks: Ranks,
        lease: Lease | None,
        threads: int = 4,
    ):
        self.src, self.dst, self.step, self.regions, self.ranks, self.lease = src, dst, step, regions, ranks, lease
        self.shared = shared
        self.threads = threads  # bounded: a persist runs beside training and must not starve it

    def run(self) -> int | None:
        """Copy and commit; returns the bytes this rank copied, or None when the step was already durable."""
        began: str | None = None
        if self.ranks.leader:
            if layout.is_committed(self.dst, self.step):
                began = "exists"
            else:
                try:
                    begin_step(self.dst, self.step, self.lease)
                except Exception as e:
                    began = f"rank 0 could not start: {described(e)}"
        began = self.ranks.broadcast_json(began)
        if began == "exists":
            return None
        if began:
            raise RuntimeError(began)
        copied, error, manifest_bytes, data = 0, None, b"", None
        fsyncs = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-persist-fsync")
        files = ChunkWriter(fsyncs) if self.dst.direct_path("") is not None else None
        try:  # every rank reaches the collectives below, whatever fails here
            manifest = layout.read_manifest(self.src, self.step)  # a missing one is named as such, not as bad JSON
            data = manifest.data  # the local save's data directory: the durable manifest names it too
            if self.ranks.leader:
                manifest_bytes = durable_manifest(manifest, self.shared).to_bytes()
            placed = {n: b for n, b in self.regions.items() if manifest.arrays[n].places}
            placed = {n: b for n, b in placed.items() if b in manifest.arrays[n].boxes}  # not its empty ones
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-persist-io") as pool:
                futures = [
                    submit_or_run(pool, copy_region, self.src, self.dst, self.step, manifest, name, box, files)
                    for name, box in self.regions.items()
                    if not manifest.arrays[name].places
                ]
                pack = layout.pack_name(self.ranks.rank)
                copied = relay_pack(
                    self.src, self.dst, self.step, manifest, self.shared, pack, placed, files, pool, self.threads
                )
                copied += sum(f.result() for f in futures)
            if files is not None:
                files.close()  # every chunk file copied is durable
        except Exception as e:
            error = request_error(self.dst, e)  # a chunk's write to an object store names its URL and endpoint
            if files is not None:
                with contextlib.suppress(Exception):
                    files.close()
        finally:
            fsyncs.shutdown(wait=True)
        reports = self.ranks.gather_json(None if error is None else f"rank {self.ranks.rank}: {described(error)}")
        failures = [f for f in reports or () if f]
        commit_error = None
        if reports is not None and not failures:
            try:
                commit_step(self.dst, self.step, manifest_bytes, self.lease)
            except Exception as e:
                commit_error = e
        try:
            raise_outcome(self.ranks, error, commit_error, failures)
        except BaseException as failed:
            if self.ranks.leader:
                self._clear(data, in_doubt=isinstance(commit_error, ManifestInDoubt), failed=failed)
            raise
        return copied

    def _clear(self, data: str | None, in_doubt: bool, failed: BaseException) -> None:
        """Remove what a failed persist wrote (nothing partial stays behind), unless the step got committed. The
        store that failed the persist may fail this too (down, refusing): then `failed`, the persist's own error, is
        the one raised, and `ckpt gc` removes the leftovers."""
        try:
            if not layout.is_committed(self.dst, self.step):
                clear_attempt(self.dst, self.step, data, self.lease, in_doubt=in_doubt)
        except Exception as e:
            log.warning(
                "persisting step %d to %s failed (%s); what it wrote stays for `ckpt gc`: %s",
                self.step,
                self.dst.url,
                described(failed),
                described(e),
            )
