"""A root on a local (POSIX) filesystem, and the file helpers of direct file IO (never following a symlink)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..pools import submit_or_run
from .protocol import checked


class UnsafeFileError(OSError):
    """A file inside a root that is a symbolic link, FIFO, directory or device: never followed nor read."""


def open_regular(path: str) -> int:
    """A read-only fd of a regular file; never follows a final symlink, never blocks on a FIFO.

    FileNotFoundError when it is missing, UnsafeFileError (naming what it is) when it is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise UnsafeFileError(e.errno, "a symbolic link" if e.errno == errno.ELOOP else "a socket", path) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFileError(errno.EINVAL, _kind(mode), path)
    return fd


def too_big(size: int, limit: int | None, path: str) -> None:
    """An UnsafeFileError when a file of `size` bytes is past `limit` (None: no limit)."""
    if limit is not None and size > limit:
        raise UnsafeFileError(errno.EFBIG, f"{size} bytes, more than the {limit} any checkpoint writes", path)


def _kind(mode: int) -> str:
    return (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a symbolic link"
        if stat.S_ISLNK(mode)
        else "not a regular file"
    )


def local_files(path: str) -> dict[str, int]:
    """Size of every file under a local directory, by relative path; UnsafeFileError on the first entry
    (the directory itself included) that is neither a regular file nor a directory. An entry deleted between the
    listing and its stat is not there (a writer's `_IN_PROGRESS` marker, removed right after its commit, made a
    restore beside it call the step it had just committed damaged); the directory itself missing is an error."""
    sizes: dict[str, int] = {}
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(errno.EINVAL, _kind(mode), path)
    stack = [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode):
                    sizes[os.path.relpath(e.path, path)] = st.st_size
                else:
                    raise UnsafeFileError(errno.EINVAL, _kind(st.st_mode), e.path)
    return sizes


class LocalStorage:
    """A root on a local (POSIX) filesystem."""

    keeps_written_buffers = False
    cheap_sizes = True
    lease_kind = "flock"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, checked(path)) if path else self.root

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return {"driver": "file", "path": self._p(path).rstrip("/") + "/"}

    def local_path(self, path: str) -> str | None:
        return self._p(path)

    def direct_path(self, path: str) -> str | None:
        return self._p(path)

    def check_root(self) -> None:
        """The root must be an existing directory."""
        if not os.path.isdir(self.root):
            what = "not a directory" if os.path.exists(self.root) else "no such directory"
            raise FileNotFoundError(f"{self.root}: {what}")

    def check_creatable(self) -> None:
        """A root must be a directory or not exist: an existing one is left to its lease (a read-only root still
        restores); a missing one needs its nearest existing ancestor to be a directory this process may write in."""
        there = self.root
        while not os.path.lexists(there):
            there = os.path.dirname(there)
        if there == self.root:
            if not os.path.isdir(there):
                raise NotADirectoryError(f"the checkpoint root {self.root} is not a directory")
            return
        if not os.path.isdir(there):
            raise NotADirectoryError(f"the checkpoint root {self.root} cannot be created: {there} is not a directory")
        longest = os.pathconf(there, "PC_NAME_MAX")
        for name in os.path.relpath(self.root, there).split(os.sep):
            if len(os.fsencode(name)) > longest:
                raise OSError(
                    errno.ENAMETOOLONG,
                    f"the checkpoint root {self.root} cannot be created: a name in it is longer than {longest} bytes",
                )
        check_writable(there, f"the checkpoint root {self.root} cannot be created")

    def list_dirs(self, path: str = "") -> list[str]:
        base = self._p(path)
        if not os.path.isdir(base):
            return []
        return sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))

    def list_files(self, path: str) -> list[str]:
        base = self._p(path)
        return sorted(os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base) for f in fs)

    def _unlinked(self, path: str) -> str:
        """`path` to read, reached from the root through no symbolic link (a step directory that is a link would
        read another place's files as this root's); UnsafeFileError otherwise. One lstat per directory below the
        root (resolving the whole path each time made listing 3,000 steps take 0.2 s)."""
        full = self._p(path)
        at = self.root
        for part in filter(None, os.path.dirname(checked(path)).split("/")):
            at = os.path.join(at, part)
            try:
                if stat.S_ISLNK(os.lstat(at).st_mode):
                    raise UnsafeFileError(errno.ELOOP, "reached through a symbolic link", full)
            except (FileNotFoundError, NotADirectoryError):
                break  # missing: the read finds it so
        return full

    def read(self, path: str, limit: int | None = None) -> bytes | None:
        """The file's bytes, None when it is missing; UnsafeFileError when it is not a regular file, is larger
        than `limit` or is reached through a symbolic link inside the root."""
        full = self._unlinked(path)
        try:
            fd = open_regular(full)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with open(fd, "rb") as f:
            too_big(os.fstat(fd).st_size, limit, full)
            return f.read()

    def read_range(self, path: str, start: int, stop: int | None) -> bytes | None:
        try:
            fd = open_regular(self._unlinked(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            end = os.fstat(fd).st_size if stop is None else stop
            return os.pread(fd, max(0, end - start), start)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _durable_temp(self, path: str, data: bytes) -> Iterator[tuple[str, str]]:
        """`data` in a fsync'd temp file beside `path` (its directory made durably): (temp, final), for the caller
        to move into place. The temp file is gone afterwards, whatever failed (a full disk leaves none behind)."""
        final = self._p(path)
        makedirs_durable(os.path.dirname(final))
        tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            yield tmp, final
        finally:
            with contextlib.suppress(FileNotFoundError):  # renamed into place, or never made
                os.remove(tmp)

    def write_atomic(self, path: str, data: bytes) -> None:
        """temp file + fsync + rename + fsync of the directory: the file is either whole or absent."""
        with self._durable_temp(path, data) as (tmp, final):
            os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a file that does not exist yet, whole or not at all; `FileExistsError` (nothing written) when it
        does: temp file + fsync, then a hard link, which never replaces an existing file (a rename would).

        `timeout` is for stores whose requests can hang; a local write has none.
        """
        with self._durable_temp(path, data) as (tmp, final):
            os.link(tmp, final)
        fsync_dir(os.path.dirname(final))

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(self._p(path), ignore_errors=True)

    def delete_file(self, path: str) -> None:
        try:
            os.remove(self._p(path))
        except FileNotFoundError:
            pass

    def move_tree(self, src: str, dst: str) -> None:
        """Rename a directory (atomic within the root's filesystem); both parents are fsync'd."""
        source, target = self._p(src), self._p(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(source, target)
        for parent in {os.path.dirname(source), os.path.dirname(target)}:
            fsync_dir(parent)

    def size(self, path: str) -> int:
        """Bytes of the files under `path`, links not followed; a file deleted meanwhile (a live writer's retention)
        counts nothing: `ls` beside a writer failed with FileNotFoundError."""
        total = 0
        for d, _, fs in os.walk(self._p(path)):
            for f in fs:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(d, f)).st_size
        return total

    def sync_tree(self, path: str) -> None:
        """fsync every directory under `path`, then its parents up to the root: the entries tensorstore created
        (array and chunk directories, chunk files) survive a power cut before a manifest vouches for them.

        The fsyncs run concurrently: one after the other they cost up to ~1 s per 250 directories on a busy
        disk, together ~10-30 ms (the device flushes coalesce).
        """
        base = self._p(path)
        with ThreadPoolExecutor(32, thread_name_prefix="ckpt-fsync") as pool:
            for f in [submit_or_run(pool, fsync_dir, d) for d, _, _ in os.walk(base)]:
                f.result()
        while base != self.root and base.startswith(self.root):
            base = os.path.dirname(base)
            fsync_dir(base)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(directory: str, what: str) -> None:
    """A PermissionError saying `what` when this process cannot create files in `directory`, and why."""
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        raise PermissionError(errno.EROFS, f"{what}: {directory} is on a read-only file system")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{what}: no permission to write in {directory}")


def makedirs_durable(path: str) -> None:
    """`os.makedirs`, and the parent of every directory it creates is fsync'd, so the new entries are durable."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d)
        fsync_dir(os.path.dirname(d))
