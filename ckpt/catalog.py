"""What a root holds and whether it is sound: listing, verification, garbage collection."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from . import store
from .checkpointer import read_manifest
from .errors import CorruptCheckpointError
from .format import ARRAYS, IN_PROGRESS, MANIFEST, parse_step_dir, step_dir
from .storage import Storage, context


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
        marker = storage.read(f"{name}/{IN_PROGRESS}")
        try:
            info = json.loads(marker) if marker else None
        except ValueError:
            info = {}
        out.append(StepEntry(step, storage.read(f"{name}/{MANIFEST}") is not None, info))
    return sorted(out, key=lambda e: e.step)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists (the commit), ascending; their integrity is checked on read."""
    return [e.step for e in entries(storage) if e.committed]


def verify(storage: Storage, step: int, on_bytes: Callable[[int], None] | None = None) -> Iterator[CorruptCheckpointError]:
    """Read every chunk of a committed step and check every checksum; yields each problem found."""
    try:
        manifest = read_manifest(storage, step)
    except CorruptCheckpointError as e:
        yield e
        return
    for name, info in manifest.arrays.items():
        path = f"{step_dir(step)}/{ARRAYS}/{name}"
        try:
            store.verify_array(storage.kvstore_spec(path), info, context(), step=step,
                               file_hint=storage.local_path(path) or storage.url + path, on_bytes=on_bytes)
        except CorruptCheckpointError as e:
            yield e


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
