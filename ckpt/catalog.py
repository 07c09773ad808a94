"""What a root holds and whether it is sound: listing, verification, garbage collection."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from . import store
from .errors import CorruptCheckpointError
from .format import ARRAYS, DAMAGED, IN_PROGRESS, MANIFEST, QUARANTINE, parse_step_dir, step_dir
from .restore import read_manifest, step_files
from .storage import Storage, UnsafeFileError, where


@dataclass
class StepEntry:
    """One step directory of a root."""

    step: int
    committed: bool
    in_progress: dict | None  # the marker of a save in flight (pid, host, time), if any


def entries(storage: Storage) -> list[StepEntry]:
    """Every step directory, committed or not, in step order."""
    out = []
    for name in storage.list_dirs():
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            marker = storage.read(f"{name}/{IN_PROGRESS}")
            info = json.loads(marker) if marker else None
        except (ValueError, UnsafeFileError):
            info = {}
        out.append(StepEntry(step, is_committed(storage, step), info))
    return sorted(out, key=lambda e: e.step)


def is_committed(storage: Storage, step: int) -> bool:
    """The step's manifest exists (a manifest that is not a regular file counts: reading it reports damage)."""
    try:
        return storage.read(f"{step_dir(step)}/{MANIFEST}") is not None
    except UnsafeFileError:
        return True


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists (the commit), ascending; their integrity is checked on read."""
    return [e.step for e in entries(storage) if e.committed]


def verify(storage: Storage, step: int, on_bytes: Callable[[int], None] | None = None) -> Iterator[CorruptCheckpointError]:
    """Check a committed step as restore does: its manifest, no special files, every array's zarr.json
    and every chunk (size, crc32c, the manifest's digest); yields each problem found."""
    try:
        manifest = read_manifest(storage, step)
        step_files(storage, step)
    except CorruptCheckpointError as e:
        yield e
        return
    for name, info in manifest.arrays.items():
        try:
            store.verify_array(storage, f"{step_dir(step)}/{ARRAYS}/{name}", info, step=step, on_bytes=on_bytes)
        except CorruptCheckpointError as e:
            yield e


def quarantine(storage: Storage, step: int, reason: str) -> str:
    """Set a damaged step aside: move it to ``_quarantine/step_N-<unix ms>/`` (with a `_DAMAGED` file saying
    why, when and by whom), so it no longer counts as committed, can be saved again, and stays for
    inspection. Returns where it went."""
    dest = f"{QUARANTINE}/{step_dir(step)}-{int(time.time() * 1000)}"
    storage.move_tree(step_dir(step), dest)
    marker = {"reason": reason, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    storage.write_atomic(f"{dest}/{DAMAGED}", json.dumps(marker).encode())
    return where(storage, dest)


def alive(marker: dict) -> bool:
    """A save marker belongs to a live process on this host, or is too young to judge."""
    if marker.get("host") != socket.gethostname():
        return time.time() - float(marker.get("time", 0)) < 24 * 3600
    try:
        os.kill(int(marker.get("pid", -1)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def garbage(storage: Storage, *, force: bool = False) -> list[StepEntry]:
    """Uncommitted step directories that no live save owns (all of them with `force`)."""
    return [e for e in entries(storage) if not e.committed and (force or not (e.in_progress and alive(e.in_progress)))]


def collect_garbage(storage: Storage, *, force: bool = False) -> list[int]:
    """Delete uncommitted leftovers of crashed saves; returns the steps removed."""
    removed = []
    for e in garbage(storage, force=force):
        storage.delete_tree(step_dir(e.step))
        removed.append(e.step)
    return removed


def delete_step(storage: Storage, step: int) -> None:
    """Remove a committed step: the manifest first (it vanishes atomically), then its arrays."""
    storage.delete_file(f"{step_dir(step)}/{MANIFEST}")
    storage.delete_tree(step_dir(step))
