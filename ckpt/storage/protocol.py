"""What the checkpointer needs from a root: the `Storage` protocol, its operations and its capabilities.

A backend is one class satisfying it. The rest of `ckpt` asks a root what it can do (its capabilities below)
and never what kind of root it is, so a new backend changes nothing outside its class.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from ..paths import validate_array_name


class Storage(Protocol):
    """The operations the checkpointer needs from a root, and what the root can do.

    Paths are relative to the root, '/'-separated, "" is the root itself.
    """

    url: str
    # True where the kvstore keeps the buffers a tensorstore write is given (memory): a write must then copy the
    # staging arena, which the next save rewrites (see `store.write`)
    keeps_written_buffers: bool
    # True where `size` costs a listing; False where it reads every object (an object store lists no sizes here)
    cheap_sizes: bool
    # How one writer per root is enforced here (`lease.py`): "flock", an exclusive lock on a file of this machine
    # (needs `local_path("")`); "conditional", an object with an expiry renewed by `read_versioned` / `write_if`
    lease_kind: Literal["flock", "conditional"]

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of `path`: where tensorstore creates and writes the arrays."""
        ...

    def local_path(self, path: str) -> str | None:
        """`path` as a file of this machine, for messages and a local lease; None when it is no file here."""
        ...

    def direct_path(self, path: str) -> str | None:
        """`path` as a file of this machine when its chunk files may be written and read as files, bypassing
        this class (`chunk_files.ChunkWriter`: O_DIRECT; `store.read_direct`: preadv; a step's listing with sizes);
        None: every byte goes through tensorstore (`kvstore_spec`) and `read`."""
        ...

    def check_root(self) -> None:
        """Raise `FileNotFoundError` when the root itself is not there (a typo is not an empty root)."""
        ...

    def check_creatable(self) -> None:
        """Raise when no save could ever create the root (a local path through a file, a directory without write
        permission), creating nothing: a manager fails where it is made, not at its first save an hour later."""
        ...

    def list_dirs(self, path: str = "") -> list[str]: ...
    def list_files(self, path: str) -> list[str]: ...

    def read(self, path: str, limit: int | None = None) -> bytes | None:
        """The file's bytes, None when it is missing; past `limit` bytes an UnsafeFileError (a local file is never
        read then: a sparse one of gigabytes costs its maker nothing, each reader its size in memory)."""
        ...

    def read_range(self, path: str, start: int, stop: int | None) -> bytes | None:
        """Bytes [start, stop) of a file (`stop` None: to its end; fewer where it is shorter), None when it is
        missing: a pack's boxes are read without reading the pack."""
        ...

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write (or replace) a file whole or not at all."""
        ...

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a file that does not exist yet, whole or not at all, never replacing one (`FileExistsError`):
        the commit of a manifest."""
        ...

    def delete_tree(self, path: str) -> None: ...
    def delete_file(self, path: str) -> None: ...
    def move_tree(self, src: str, dst: str) -> None: ...
    def size(self, path: str) -> int: ...

    def sync_tree(self, path: str) -> None:
        """Make everything written under `path` (tensorstore's files included) durable, before a manifest vouches
        for it."""
        ...


def checked(path: str) -> str:
    """`path`, once it is known to be a valid path inside a root (no '..', no absolute path)."""
    validate_array_name(path)
    return path


def where(storage: Storage, path: str) -> str:
    """A path of a root as a user finds it: the local file, or the URL."""
    return storage.local_path(path) or f"{storage.url}{path}"
