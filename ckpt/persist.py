"""Mechanism of a persist: a step committed in the local tier copied to the durable root, verified, manifest last.

No second snapshot from training memory: the bytes come from the local tier's committed files. Every chunk is
checked on the way (size, its crc32c, the manifest's digest) and every zarr.json against the manifest, so a
damaged local copy never becomes a durable checkpoint. Among ranks each copies the regions it is the designated
writer of (replicated tensors once), and the leader commits for all, exactly as a save does. The manager
(policy, through `tiers.py`) decides which steps and when.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

from . import layout, store
from .chunk_files import ChunkWriter
from .distributed import Box, Ranks
from .errors import CorruptCheckpointError
from .format import Manifest, chunk_key, zarr_mismatch
from .lease import Lease
from .save import begin_step, clear_attempt, commit_step, raise_outcome
from .storage import Storage, where


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


class PersistJob:
    """One persist of `step` from `src` (this rank's local tier) to `dst` (the durable root), run on every rank."""

    def __init__(
        self,
        src: Storage,
        dst: Storage,
        step: int,
        regions: Mapping[str, Box],
        ranks: Ranks,
        lease: Lease | None,
        threads: int = 4,
    ):
        self.src, self.dst, self.step, self.regions, self.ranks, self.lease = src, dst, step, regions, ranks, lease
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
                    began = f"rank 0 could not start: {type(e).__name__}: {e}"
        began = self.ranks.broadcast_json(began)
        if began == "exists":
            return None
        if began:
            raise RuntimeError(began)
        copied, error, manifest_bytes, data = 0, None, b"", None
        fsyncs = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-persist-fsync")
        files = ChunkWriter(fsyncs) if self.dst.direct_path("") is not None else None
        try:  # every rank reaches the collectives below, whatever fails here
            manifest_bytes = self.src.read(layout.manifest_path(self.step)) or b""
            manifest = Manifest.from_bytes(manifest_bytes, file=where(self.src, layout.manifest_path(self.step)))
            data = manifest.data  # the local save's data directory: the manifest, copied as it is, names it
            with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-persist-io") as pool:
                futures = [
                    pool.submit(copy_region, self.src, self.dst, self.step, manifest, name, box, files)
                    for name, box in self.regions.items()
                ]
                copied = sum(f.result() for f in futures)
            if files is not None:
                files.close()  # every chunk file copied is durable
        except Exception as e:
            error = e
            if files is not None:
                with contextlib.suppress(Exception):
                    files.close()
        finally:
            fsyncs.shutdown(wait=True)
        reports = self.ranks.gather_json(
            None if error is None else f"rank {self.ranks.rank}: {type(error).__name__}: {error}"
        )
        failures = [f for f in reports or () if f]
        commit_error = None
        if reports is not None and not failures:
            try:
                commit_step(self.dst, self.step, manifest_bytes, self.lease)
            except Exception as e:
                commit_error = e
        try:
            raise_outcome(self.ranks, error, commit_error, failures)
        except BaseException:
            if self.ranks.leader and not layout.is_committed(self.dst, self.step):  # nothing partial stays behind
                clear_attempt(self.dst, self.step, data, self.lease)
            raise
        return copied
