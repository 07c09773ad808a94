"""A test backend written only against `ckpt.storage.Storage`: another root's storage with faults injected.

It is also the example of a backend (docs/architecture.md, "Where a new piece goes"): a `CheckpointManager` takes
it as its root unchanged. By default it has no direct file IO (`direct_path` is None), so every byte the checkpointer
reads, and every file it writes itself (markers, the manifest), goes through this class; tensorstore writes the arrays
into the wrapped root (`kvstore_spec`). With `direct=True` it gives the wrapped root's direct paths, as a local root
does: chunk files are then read as files, and a restore lists a step's files itself (`layout.step_files`, through
the step directory's direct path).
"""

from __future__ import annotations

from typing import Any, Callable

from ckpt.storage import Storage


class InjectedFault(OSError):
    """The error a failing write or read raises."""


class FaultStorage:
    """`inner` as it is, except: the `fail_write`-th write (write_atomic or create, counting from 1) of a path
    `fail_path` accepts raises `InjectedFault`, nothing written; a read of a path `corrupt` accepts returns its
    bytes with one bit flipped; a whole read (`read`) of a path `fail_read` accepts raises `InjectedFault` (an
    unreadable file: a ranged read of it, as of its first byte, still succeeds), a ranged read (`read_range`) of a path
    `fail_range` accepts raises `InjectedFault` (an I/O error in the middle of a file), a read of a path `hide` accepts finds
    nothing (a file deleted meanwhile), a listing of a directory `fail_list` accepts raises `InjectedFault` (with
    `direct`, a step's listing too: its direct path is asked for first). `reads` and `writes` record every path read
    and written through it, `read_bytes` the bytes each read returned (path, bytes), `directs` every direct path asked
    for (with `direct`: one of a step directory is a listing of that step), in order."""

    def __init__(
        self,
        inner: Storage,
        *,
        fail_path: Callable[[str], bool] = lambda path: False,
        fail_write: int = 1,
        corrupt: Callable[[str], bool] = lambda path: False,
        fail_read: Callable[[str], bool] = lambda path: False,
        hide: Callable[[str], bool] = lambda path: False,
        fail_list: Callable[[str], bool] = lambda path: False,
        fail_range: Callable[[str], bool] = lambda path: False,
        direct: bool = False,
    ):
        self.inner, self.fail_path, self.fail_write, self.corrupt = inner, fail_path, fail_write, corrupt
        self.fail_read, self.hide, self.fail_list, self.direct = fail_read, hide, fail_list, direct
        self.fail_range = fail_range
        self.url = inner.url
        self.keeps_written_buffers = inner.keeps_written_buffers
        self.cheap_sizes = inner.cheap_sizes
        self.lease_kind = inner.lease_kind
        self.reads: list[str] = []
        self.read_bytes: list[tuple[str, int]] = []
        self.writes: list[str] = []
        self.directs: list[str] = []
        self._matching_writes = 0

    def _written(self, path: str) -> None:
        """Count a write; raise before it happens when it is the one to fail."""
        self.writes.append(path)
        if self.fail_path(path):
            self._matching_writes += 1
            if self._matching_writes == self.fail_write:
                raise InjectedFault(f"injected fault: write {self._matching_writes} of {path}")

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return self.inner.kvstore_spec(path)

    def local_path(self, path: str) -> str | None:
        return self.inner.local_path(path)

    def direct_path(self, path: str) -> str | None:
        if not self.direct:
            return None
        self.directs.append(path)
        if self.fail_list(path):  # a step's directory: `layout.step_files` lists what this path holds
            raise InjectedFault(f"injected fault: listing of {path!r}")
        return self.inner.direct_path(path)

    def check_root(self) -> None:
        self.inner.check_root()

    def check_creatable(self) -> None:
        self.inner.check_creatable()

    def list_dirs(self, path: str = "") -> list[str]:
        if self.fail_list(path):
            raise InjectedFault(f"injected fault: listing of {path!r}")
        return self.inner.list_dirs(path)

    def list_files(self, path: str) -> list[str]:
        return self.inner.list_files(path)

    def _read(self, path: str) -> bool:
        """Record a read; whether it finds anything (False: hidden)."""
        self.reads.append(path)
        return not self.hide(path)

    def read(self, path: str, limit: int | None = None) -> bytes | None:
        found = self._read(path)
        if self.fail_read(path):
            raise InjectedFault(f"injected fault: read of {path}")
        data = self.inner.read(path, limit) if found else None
        self.read_bytes.append((path, len(data or b"")))
        if data and self.corrupt(path):
            return bytes([data[0] ^ 1]) + data[1:]
        return data

    def read_range(self, path: str, start: int, stop: int | None) -> bytes | None:
        if self.fail_range(path):
            self.reads.append(path)
            raise InjectedFault(f"injected fault: read of bytes [{start}, {stop}) of {path}")
        data = self.inner.read_range(path, start, stop) if self._read(path) else None
        self.read_bytes.append((path, len(data or b"")))
        if data and self.corrupt(path):
            return bytes([data[0] ^ 1]) + data[1:]
        return data

    def write_atomic(self, path: str, data: bytes) -> None:
        self._written(path)
        self.inner.write_atomic(path, data)

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        self._written(path)
        self.inner.create(path, data, timeout)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move_tree(self, src: str, dst: str) -> None:
        self.inner.move_tree(src, dst)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def sync_tree(self, path: str) -> None:
        self.inner.sync_tree(path)

    # the conditional writes `lease.KvLease` takes an object store's lease with (when `inner` is one)
    def read_versioned(self, path: str, timeout: float | None = None) -> tuple[bytes | None, bytes]:
        return self.inner.read_versioned(path, timeout)

    def write_if(self, path: str, data: bytes | None, generation: bytes, timeout: float | None = None) -> bytes | None:
        return self.inner.write_if(path, data, generation, timeout)
