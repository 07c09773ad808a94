"""What a root holds and whether it is sound: listing, verification, garbage collection."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from . import layout, lease, packs, store
from .errors import CorruptCheckpointError, LeaseHeldError, StepNotFoundError
from .storage import Storage, UnsafeFileError, where


@dataclass
class StepEntry:
    """One step directory of a root."""

    step: int
    committed: bool
    in_progress: dict[str, Any] | None  # the marker of a save (pid, host, time, lease); {} when unreadable

    @property
    def owner(self) -> str | None:
        """The lease id of the writer that started this save, if its marker names one."""
        owner = (self.in_progress or {}).get("lease")
        return owner if isinstance(owner, str) else None


@dataclass
class QuarantinedStep:
    """A damaged step moved aside to ``_quarantine/<name>/`` (no longer committed, kept for inspection)."""

    step: int
    name: str
    reason: str
    time: float | None

    @property
    def path(self) -> str:
        return layout.quarantined_path(self.name)


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    """A small JSON file written by this library, or {} when present but unreadable (a crafted or torn file)."""
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def entries(storage: Storage) -> list[StepEntry]:
    """Every step directory, committed or not, in step order."""
    out = []
    for step in layout.step_dirs(storage):
        try:
            marker = _json_object(storage.read(layout.in_progress_path(step)))
        except UnsafeFileError:
            marker = {}
        out.append(StepEntry(step, layout.is_committed(storage, step), marker))
    return out


def quarantined(storage: Storage) -> list[QuarantinedStep]:
    """Damaged steps moved to ``_quarantine/`` (by a restore that skipped them), in step order."""
    out = []
    for step, name in layout.quarantined_dirs(storage):
        try:
            record = _json_object(storage.read(layout.damaged_path(layout.quarantined_path(name)))) or {}
        except UnsafeFileError:  # a FIFO or a link planted there: no record, and the listing goes on
            record = {}
        reason = record.get("reason")
        when = record.get("time")
        out.append(
            QuarantinedStep(
                step,
                name,
                reason if isinstance(reason, str) else f"no readable {layout.DAMAGED} record",
                float(when) if type(when) in (int, float) and -(2**53) <= when <= 2**53 else None,
            )
        )
    return sorted(out, key=lambda q: (q.step, q.name))


def verify(
    storage: Storage, step: int, on_bytes: Callable[[int], None] | None = None
) -> Iterator[CorruptCheckpointError]:
    """Check a committed step as restore does: its manifest, no special files, every array's zarr.json
    and every chunk (size, crc32c, the manifest's digest), every packed tensor's bytes against its digest and
    every chunk of the packs; yields each problem found. A rank's own root (`Manifest.held`) is checked for the
    boxes it holds: the others are in the other ranks' roots."""
    try:
        manifest = layout.read_manifest(storage, step)
        layout.step_files(storage, step)
    except CorruptCheckpointError as e:
        yield e
        return
    used: set[str] = set()  # the packs holding a box checked
    for name, info in manifest.arrays.items():
        boxes = manifest.boxes_here(name)
        try:
            if info.places is None:
                if boxes:
                    path = layout.array_path(step, name, manifest.data)
                    box = None if manifest.held is None else info.boxes[boxes[0]]
                    store.verify_array(storage, path, info, step=step, on_bytes=on_bytes, box=box)
                continue
            for box in boxes:
                pack = info.places[box][0]
                used.add(pack)
                path = layout.pack_path(step, pack, manifest.data)
                packs.verify_box(storage, manifest.packs[pack], path, info, box, step=step)
                if on_bytes:
                    on_bytes(info.box_nbytes(info.boxes[box]))
        except CorruptCheckpointError as e:
            yield e
    for name, pack in manifest.packs.items():  # zarr.json, each file's size, and (ckpt/3-4) each file's crc32c
        if manifest.held is not None and name not in used:
            continue
        try:
            path = layout.pack_path(step, name, manifest.data)
            if pack.raw:
                store.check_zarr_json(storage, path, pack, step=step)
                packs.check_sizes(storage, path, pack, step=step)
            else:
                store.verify_array(storage, path, pack, step=step)
        except CorruptCheckpointError as e:
            yield e


def quarantine(storage: Storage, step: int, reason: str) -> str:
    """Set a damaged step aside: move it to ``_quarantine/step_N-<unix ms>/`` (with a `_DAMAGED` file saying
    why, when and by whom), so it no longer counts as committed, can be saved again, and stays for
    inspection. Returns where it went."""
    dest = layout.quarantine_path(step, int(time.time() * 1000))
    storage.move_tree(layout.step_dir(step), dest)
    marker = {"reason": reason, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    storage.write_atomic(layout.damaged_path(dest), json.dumps(marker).encode())
    return where(storage, dest)


def garbage(storage: Storage, *, force: bool = False, writer: Storage | None = None) -> list[StepEntry]:
    """Uncommitted step directories that no live writer owns (all of them with `force`).

    Without a live writer, everything uncommitted is a leftover. Beside a live writer whose lease is exclusive (a
    local root's flock), a leftover is a directory whose marker names another (dead) writer's lease, or none;
    beside one whose lease is not (an object store's) nothing is (gc leaves it to a later run: a writer that lost
    the lease may still be writing, and there is no lock to exclude a save). `writer`: the root whose lease covers
    this one, when it is another (a peer replica: the local tier it lies in, whose writer receives into it).
    """
    uncommitted = [e for e in entries(storage) if not e.committed]
    holder = None if force else lease.live_holder(writer or storage)
    if holder is None:
        return uncommitted
    if writer is not None or not lease.lease_class(storage).exclusive:
        return []
    return [e for e in uncommitted if e.owner != holder.get("id")]


def collect_garbage(storage: Storage, *, force: bool = False, writer: Storage | None = None) -> list[int]:
    """Delete uncommitted leftovers of crashed saves, never a live save (unless `force`); returns the steps removed.

    gc takes the root's lease itself when it is free, so no save can start while it deletes. Beside a
    live writer it holds what keeps that writer's saves from starting (`beside_writer`: a local root's ``_GC_LOCK``,
    which every save holds while it marks itself in progress) and spares the directories whose marker names the
    live writer's lease; where nothing can (object stores), it deletes nothing.

    `writer`: the root whose lease covers this one, when it is another. A peer replica (``_replica/rank_R/`` of a
    local tier) is written by the local tier's writer, whose transfers mark no lease of the replica: gc takes the
    local tier's lease, and beside its live writer deletes nothing there (a replica it receives is a live save).
    """
    uncommitted = [e for e in entries(storage) if not e.committed]
    if force or not uncommitted:  # nothing to delete: no lease taken, so no save waits for gc
        return _delete_uncommitted(storage, uncommitted)
    held = _gc_lease(writer or storage)
    if held is not None:
        try:
            return _delete_uncommitted(storage, [e for e in entries(storage) if not e.committed])
        finally:
            held.release()
    if writer is not None:
        return []
    with lease.lease_class(storage).beside_writer(storage) as holder:
        return [] if holder is None else _delete_leftovers(storage, holder.get("id"))


def collect_leftovers(storage: Storage, writer: lease.Lease) -> list[int]:
    """The root's writer deleting what crashed saves and interrupted deletes (a kill during retention) left: every
    uncommitted step directory not marked by `writer`'s own saves. Only under an exclusive lease (a local root's
    flock: no other writer lives); elsewhere nothing, as `collect_garbage` does beside a live writer."""
    if not writer.exclusive:
        return []
    with lease.lease_class(storage).beside_writer(storage):
        return _delete_leftovers(storage, writer.id)


def _delete_leftovers(storage: Storage, writer_id: str | None) -> list[int]:
    """Under ``_GC_LOCK``: delete the uncommitted step directories whose marker names another writer, or none."""
    return _delete_uncommitted(storage, [e for e in entries(storage) if not e.committed and e.owner != writer_id])


def stale_data(storage: Storage) -> list[tuple[int, str]]:
    """(step, directory) of every data directory in a committed step that its manifest does not name: the files of
    another save of that step (one that lost the root's lease, or crashed beside a live writer of an object store).
    Never read; a step whose manifest is damaged is left as it is."""
    found = []
    for step in layout.committed_steps(storage):
        try:
            named = layout.read_manifest(storage, step).data
        except (CorruptCheckpointError, StepNotFoundError):
            continue
        found += [(step, d) for d in layout.data_dirs(storage, step) if d != named]
    return found


def collect_stale_data(storage: Storage, *, force: bool = False) -> list[tuple[int, str]]:
    """Delete the data directories `stale_data` finds, only while no writer holds the root (its lease taken here;
    a live writer's own saves never leave any); returns what was removed."""
    stale = stale_data(storage)
    if not stale:
        return []
    held = None if force else _gc_lease(storage)
    if held is None and not force:
        return []
    try:
        stale = stale_data(storage)  # under the lease
        for step, d in stale:
            storage.delete_tree(layout.data_path(step, d))
        return stale
    finally:
        if held is not None:
            held.release()


def _gc_lease(storage: Storage) -> lease.Lease | None:
    """The root's lease for gc, at once, or None while a writer (or another gc) holds it."""
    try:
        return lease.acquire(storage, role="gc", wait_for_gc=0)
    except LeaseHeldError:
        return None


def _delete_uncommitted(storage: Storage, victims: list[StepEntry]) -> list[int]:
    for e in victims:
        storage.delete_tree(layout.step_dir(e.step))
    return [e.step for e in victims]


def collect_damaged(storage: Storage) -> list[QuarantinedStep]:
    """Delete the quarantined (damaged) steps; returns what was removed."""
    removed = quarantined(storage)
    for q in removed:
        storage.delete_tree(q.path)
    return removed


def roll_back_plan(roots: Sequence[Storage], step: int) -> list[tuple[Storage, int]]:
    """(root, step) of every committed step after `step` in `roots` (a run's durable root, local tiers and their
    replicas: what a resume could take), newest first: what a roll back to `step` removes. Refused, naming why,
    when no root holds a committed step at or before `step` (nothing would be left to resume), or when the newest
    of them, the step the run resumes from, is damaged wherever it is (`verify`: every byte is read)."""
    committed = [(root, layout.committed_steps(root)) for root in roots]
    kept = [s for _, steps in committed for s in steps if s <= step]
    if not kept:
        raise StepNotFoundError(
            f"no committed step of {', '.join(r.url for r in roots)} is at or before step {step} (committed: "
            f"{sorted({s for _, steps in committed for s in steps})}): rolling back would leave nothing to resume"
        )
    resume = max(kept)
    damage = [next(verify(root, resume), None) for root, steps in committed if resume in steps]
    if all(damage):
        raise CorruptCheckpointError(
            f"step {resume}, which a roll back to step {step} resumes from, is damaged ({damage[0].message}); "
            f"nothing was deleted: roll back to an earlier step",
            step=resume,
            key=damage[0].key,
            file=damage[0].file,
        )
    return sorted(((root, s) for root, steps in committed for s in steps if s > step), key=lambda rs: -rs[1])


def roll_back(roots: Sequence[Storage], step: int) -> list[tuple[Storage, int]]:
    """Delete what `roll_back_plan` names, newest step first, holding every root's lease (`LeaseHeldError` while a
    writer holds one): a run resumed from `step` saves those step numbers again, and a committed step is never
    overwritten. A kill midway leaves the newest steps gone and the others whole; returns what was removed."""
    held: list[lease.Lease] = []
    try:
        for root in roots:
            held.append(lease.acquire(root, role="gc", wait_for_gc=0))
        removed = roll_back_plan(roots, step)  # under the leases
        for root, s in removed:
            delete_step(root, s)
        return removed
    finally:
        for taken in held:
            taken.release()


def delete_step(storage: Storage, step: int) -> None:
    """Remove a committed step: the manifest first (it vanishes atomically), then its arrays. A directory in the
    manifest's place (a damaged step, which no reader takes) goes with the tree: retention failed on it for good."""
    with contextlib.suppress(IsADirectoryError):
        storage.delete_file(layout.manifest_path(step))
    storage.delete_tree(layout.step_dir(step))
