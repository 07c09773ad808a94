"""Where everything of a root lives: the one owner of its names and paths, and of "is this step committed?".

Layout of a root::

    step_00001200/manifest.json      written last, never replaced; its presence is the commit
    step_00001200/w-<token>/         one save's data (the manifest names it): each save of the step writes into a
                                     directory of its own, so a writer that lost the lease never touches the files
                                     its successor commits (before ckpt/4: arrays/ and packs/ in the step directory)
    step_00001200/w-<token>/packs/rank_00000/  one zarr3 uint8 array per rank: every box it writes, in <= 4 files
                                               (in a rank's own root, the local tier: every box it holds)
    step_00001200/w-<token>/arrays/<name>/     a zarr3 array of its own (zarr.json + chunk files c/...): an empty
                                               tensor, or any with pack_bytes=0
    step_00001200/_IN_PROGRESS       marker of a save in flight (pid, host, time, lease); never read on restore
    _quarantine/step_00001200-<unix ms>/   a damaged step moved aside: its files and _DAMAGED (reason, time, host, pid)
    _LEASE, _GC_LOCK                 the writer's lease and gc's lock (see lease.py)
    run.json                         the run the root belongs to (see run.py)
    _replica/rank_00003/             (local tier) a peer's local tier replicated here: a root of the same layout

Every other module builds a path of a root through these functions. A step is committed when its manifest
exists: `is_committed` asks, `read_manifest` reads it (validated) or raises `StepNotFoundError`.
"""

from __future__ import annotations

import os
import posixpath
import re
import secrets
import stat
from dataclasses import dataclass
from typing import Any

from . import tree as tree_mod
from .errors import CorruptCheckpointError, StepExistsError, StepNotFoundError
from .format import DATA_RE, Manifest
from .storage import Storage, UnsafeFileError, local_files, where

MANIFEST = "manifest.json"
IN_PROGRESS = "_IN_PROGRESS"
ARRAYS = "arrays"
PACKS = "packs"
QUARANTINE = "_quarantine"
DAMAGED = "_DAMAGED"
LEASE = "_LEASE"
GC_LOCK = "_GC_LOCK"
RUN_FILE = "run.json"
REPLICA = "_replica"
_STEP_RE = re.compile(r"step_([0-9]{8,})")
_QUARANTINED_RE = re.compile(r"step_([0-9]{8,})-([0-9]+)")


STEP_LIMIT = 1 << 63  # steps are below it: a signed 64-bit counter (the CLI, other tools) holds every one


def step_dir(step: int) -> str:
    """The directory of a step; zero-padded so names sort by step."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < STEP_LIMIT:
        raise ValueError(f"step must be a non-negative int below 2**63, got {step!r}")
    return f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory: only `step_dir`'s own
    spelling is one (a stray ``step_9223372036854775808`` failed every listing of the root, and
    ``step_000000000100`` listed step 100 twice)."""
    m = _STEP_RE.fullmatch(name)
    return _canonical(m.group(1)) if m else None


def step_dir_hint(storage: Storage) -> str:
    """Where a root without steps is a step directory (`ROOT/step_00000100` given as the root): the root it belongs
    to, to add to the error; else ''."""
    head, name = posixpath.split(storage.url.rstrip("/"))
    step = parse_step_dir(name)
    return "" if step is None else f" ({name} is step {step}'s directory: its root is {head})"


def check_not_a_step(storage: Storage) -> None:
    """ValueError when the root is a committed step's directory (``ROOT/step_00000100``): a manager there finds no
    step, so its restore would start fresh (an evaluation on random weights) and its saves go inside that step."""
    hint = step_dir_hint(storage)
    if hint and storage.read_range(MANIFEST, 0, 1) is not None:
        raise ValueError(f"the checkpoint root {storage.url} is a committed step, not a root{hint}: give the root")


def _canonical(digits: str) -> int | None:
    """The step `digits` spell as `step_dir` writes it (below 2**63, padded to 8 digits and no more), else None."""
    step = int(digits) if len(digits) <= 19 else STEP_LIMIT
    return step if step < STEP_LIMIT and digits == f"{step:08d}" else None


def manifest_path(step: int) -> str:
    """The manifest of a step: written last, its presence is the commit."""
    return f"{step_dir(step)}/{MANIFEST}"


def in_progress_path(step: int) -> str:
    """The marker a save keeps in its step directory while it is in flight."""
    return f"{step_dir(step)}/{IN_PROGRESS}"


def new_data_dir() -> str:
    """A fresh directory name for one save's data inside its step directory (`Manifest.data`)."""
    return f"w-{secrets.token_hex(6)}"


def data_dirs(storage: Storage, step: int) -> list[str]:
    """The save data directories inside a step directory (its committed save's, and any left by other saves)."""
    return [d for d in storage.list_dirs(step_dir(step)) if DATA_RE.match(d)]


def data_path(step: int, data: str) -> str:
    """A save's data directory of a step, relative to the root."""
    return f"{step_dir(step)}/{data}"


def _under(data: str, path: str) -> str:
    return f"{data}/{path}" if data else path


def array_dir(name: str, data: str = "") -> str:
    """The directory of an array, relative to its step directory (as a step's file listing names it); `data`: the
    save's data directory (`Manifest.data`; "" before ckpt/4)."""
    return _under(data, f"{ARRAYS}/{name}")


def array_path(step: int, name: str, data: str = "") -> str:
    """The directory of an array of a step, relative to the root."""
    return f"{step_dir(step)}/{array_dir(name, data)}"


def replica_root(rank: int) -> str:
    """Where a local tier keeps the replica of rank `rank`'s local tier (a root of the same layout)."""
    return f"{REPLICA}/rank_{rank:05d}"


def replica_ranks(storage: Storage) -> list[int]:
    """The ranks whose local tier has a replica in this local tier."""
    return sorted(int(n[5:]) for n in storage.list_dirs(REPLICA) if re.fullmatch(r"rank_\d{5,}", n))


def pack_name(rank: int) -> str:
    """The name of the pack array a rank places its boxes in."""
    return f"rank_{rank:05d}"


def pack_dir(name: str, data: str = "") -> str:
    """The directory of a pack array, relative to its step directory."""
    return _under(data, f"{PACKS}/{name}")


def pack_path(step: int, name: str, data: str = "") -> str:
    """The directory of a pack array of a step, relative to the root."""
    return f"{step_dir(step)}/{pack_dir(name, data)}"


def quarantine_path(step: int, unix_ms: int) -> str:
    """Where a damaged step is moved aside: ``_quarantine/step_N-<unix ms>``."""
    return f"{QUARANTINE}/{step_dir(step)}-{unix_ms}"


def quarantined_path(name: str) -> str:
    """A quarantined step by its directory name under ``_quarantine/``."""
    return f"{QUARANTINE}/{name}"


def parse_quarantined_dir(name: str) -> int | None:
    """The step a directory under ``_quarantine/`` holds (``step_XXXXXXXX-<unix ms>``), or None."""
    m = _QUARANTINED_RE.fullmatch(name)
    return _canonical(m.group(1)) if m else None


def damaged_path(quarantined: str) -> str:
    """The record (reason, time, host, pid) beside a quarantined step's files."""
    return f"{quarantined}/{DAMAGED}"


def step_dirs(storage: Storage) -> list[int]:
    """Every step that has a directory, committed or not, ascending."""
    return sorted(s for s in map(parse_step_dir, storage.list_dirs()) if s is not None)


def quarantined_dirs(storage: Storage) -> list[tuple[int, str]]:
    """(step, directory name) of every quarantined step under ``_quarantine/``."""
    found = ((parse_quarantined_dir(name), name) for name in storage.list_dirs(QUARANTINE))
    return [(step, name) for step, name in found if step is not None]


def is_committed(storage: Storage, step: int) -> bool:
    """The step's manifest exists (a manifest that is not a regular file counts: reading it reports damage)."""
    try:
        return storage.read_range(manifest_path(step), 0, 1) is not None  # one byte: a manifest may be 100 MB
    except UnsafeFileError:
        return True


def check_step_free(storage: Storage, step: int) -> None:
    """StepExistsError when a step's name in a local root is taken by a file or a symbolic link: no save can write
    there, and the save's own error named something else (the link "already committed", the file a
    NotADirectoryError from inside the write)."""
    path = storage.direct_path(step_dir(step))  # where a step is a directory of this machine's
    if path is None:
        return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "a file"
        raise StepExistsError(
            f"step {step} cannot be saved: {path} is {what}, not a step directory; move it out of the root"
        )


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists (the commit), ascending; their integrity is checked on read."""
    return [s for s in step_dirs(storage) if is_committed(storage, s)]


def nothing_committed(storage: Storage) -> str:
    """The words for a root without a committed step, with its root when it is a step's directory."""
    return f"no committed checkpoint in {storage.url}{step_dir_hint(storage)}"


def newest_committed(storage: Storage) -> int:
    """The newest committed step of the root; StepNotFoundError (`nothing_committed`) when it has none."""
    steps = committed_steps(storage)
    if not steps:
        raise StepNotFoundError(nothing_committed(storage))
    return steps[-1]


MAX_MANIFEST_BYTES = 1 << 30  # 1,000 ranks of 2,000 tensors write ~110 MB (docs/benchmarks.md)


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The validated manifest of a committed step; StepNotFoundError when the step is not committed.

    Validated means: checksum, schema and bounds of every field, the state tree's tags, depth and
    references; any defect is a CorruptCheckpointError naming the file.
    """
    return parse_manifest(storage, step, read_manifest_bytes(storage, step))


def read_manifest_bytes(storage: Storage, step: int) -> bytes:
    """The bytes of a committed step's manifest, unchecked (`parse_manifest` checks them); StepNotFoundError when the
    step is not committed, CorruptCheckpointError when the manifest is no regular file."""
    path = manifest_path(step)
    try:
        data = storage.read(path, MAX_MANIFEST_BYTES)
    except UnsafeFileError as e:
        raise CorruptCheckpointError(f"manifest is {e.strerror}", step=step, file=where(storage, path)) from None
    if data is None:
        raise StepNotFoundError(f"step {step} is not committed in {storage.url} (no {path})")
    return data


def parse_manifest(storage: Storage, step: int, data: bytes) -> Manifest:
    """The manifest of `step` of `storage` from its bytes, validated as `read_manifest` says (wherever the bytes came
    from: this process's read, or the leader's sent over the ranks' group)."""
    file = where(storage, manifest_path(step))
    m = Manifest.from_bytes(data, file=file)
    if m.step != step:
        raise CorruptCheckpointError(f"manifest says step {m.step}", step=step, file=file)
    tree_mod.check_tree(m.tree, m.arrays, file=file, world_size=m.world_size)
    return m


def saved_metadata(storage: Storage, step: int) -> dict[str, Any]:
    """A committed step's save metadata, for a retention policy that asks; {} when its manifest is unreadable or
    gone (a policy then keeps or drops it by its other rules)."""
    try:
        return read_manifest(storage, step).metadata
    except (CorruptCheckpointError, StepNotFoundError):
        return {}


@dataclass
class StepFiles:
    """The files of a local step directory: where it is, and each file's size by path relative to it."""

    dir: str
    sizes: dict[str, int]


def step_files(storage: Storage, step: int) -> StepFiles | None:
    """The files of a step of a root with direct file IO (None for other roots). A symlink, FIFO or other special
    file anywhere in the step is damage: nothing inside a step is ever followed or opened."""
    local = storage.direct_path(step_dir(step))
    if local is None:
        return None
    try:
        return StepFiles(local, local_files(local))
    except UnsafeFileError as e:
        raise CorruptCheckpointError(f"step holds {e.strerror}", step=step, file=e.filename) from None
    except FileNotFoundError as e:  # deleted while listed: the caller tells damage from retention
        raise CorruptCheckpointError(f"step directory changed while being read: {e}", step=step, file=local) from None
