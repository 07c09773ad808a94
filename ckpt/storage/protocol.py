"""What the checkpointer needs from a root: the `Storage` protocol."""

from __future__ import annotations

from typing import Any, Protocol

from ..format import validate_array_name


class Storage(Protocol):
    """The operations the checkpointer needs from a root.

    Paths are relative to the root, '/'-separated, "" is the root itself.
    """

    url: str

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of `path`: where tensorstore creates and writes the arrays."""
        ...

    def local_path(self, path: str) -> str | None:
        """`path` as a file of this machine; None when it is no file here."""
        ...

    def list_dirs(self, path: str = "") -> list[str]: ...
    def list_files(self, path: str) -> list[str]: ...

    def read(self, path: str) -> bytes | None:
        """The file's bytes, None when it is missing."""
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
