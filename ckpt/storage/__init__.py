"""Where a checkpoint root lives: one backend class per kind of root, behind the `Storage` protocol.

A local directory is accessed through the OS (atomic rename + fsync for the commit: `local.LocalStorage`),
anything else (``memory://``, ``gs://``, ``s3://`` ...) through tensorstore's own kvstore (`kv.KvStorage`), which
also writes the arrays, so a root is never read through one store and written through another (fsspec's
``memory://`` and tensorstore's ``memory`` are different stores). `spec.py` turns URLs and options into kvstore
specs; `open_storage` picks the backend of a root.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import fsspec

from ..errors import StorageError
from .local import (
    LocalStorage,
    UnsafeFileError,
    check_writable,
    fsync_dir,
    local_files,
    makedirs_durable,
    open_regular,
)
from .protocol import Storage, where
from .spec import DEFAULT_TIMEOUT_S, STORAGE_OPTIONS, context, kvstore_spec, retries, validated_options

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STORAGE_OPTIONS",
    "KvStorage",
    "LocalStorage",
    "Storage",
    "StorageError",
    "UnsafeFileError",
    "check_writable",
    "context",
    "fsync_dir",
    "kvstore_spec",
    "local_dir",
    "local_files",
    "makedirs_durable",
    "open_regular",
    "open_storage",
    "request_error",
    "retries",
    "where",
]


# The schemes of the URLs a root is given by (tensorstore's kvstores, and other stores' that a user may type): a
# relative path starting with one and a colon, but no '//', is a mistyped URL rather than a directory of that name.
_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs", "http", "https", "file", "local", "memory")


_MEANT = {"s3a": "s3", "s3n": "s3"}  # Hadoop's names of the S3 scheme, which tensorstore does not open


def _check_scheme(url: str) -> None:
    """A URL whose scheme tensorstore opens under another spelling (``S3://``, Hadoop's ``s3a://``) is a ValueError
    naming the one meant; tensorstore's own error ("unsupported URL scheme") says nothing of it."""
    scheme, sep, rest = url.partition("://")
    meant = _MEANT.get(scheme.lower(), scheme.lower())
    if sep and meant != scheme:
        raise ValueError(f"{url!r}: tensorstore does not open {scheme}:// URLs; did you mean '{meant}://{rest}'?")


def local_dir(url: str) -> str | None:
    """The directory of this machine that a path or a ``file://`` (``local://``) URL names; None for another URL.
    ``file://localhost/PATH`` is ``/PATH``; another host is refused: ``file://mnt/ckpt`` (two slashes) would
    otherwise be the directory ``mnt/ckpt`` under whatever the working directory is. So is a URL missing its
    '//' (``s3:bucket/run``, ``gs:/bucket``, ``file:/ckpt``): as a path it is a directory ``s3:bucket/run`` under the
    working directory, where every save would land in silence (``./s3:bucket/run`` is that directory)."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol not in (None, "file", "local"):
        return None
    if protocol is None:
        scheme, colon, rest = path.partition(":")
        if colon and scheme.lower() in _SCHEMES:
            file = scheme.lower() in ("file", "local")
            meant = rest if file else f"{scheme.lower()}://{rest.lstrip('/')}"
            raise ValueError(
                f"{url!r} looks like a URL missing its '//': did you mean {meant!r}? "
                f"(a local directory of that name is './{url}')"
            )
        return path
    if path.startswith("/"):
        return path
    host, _, rest = path.partition("/")
    if host == "localhost" and rest:
        return "/" + rest
    if host == "localhost":  # "/" by the letter: the file system's root, where a save would land beside /etc
        raise ValueError(f"{url!r} names no directory: {protocol}://localhost/PATH is /PATH")
    raise ValueError(f"{url!r} names the host {host!r}: a directory of this machine is {protocol}:///{path} or a path")


def open_storage(root: str | os.PathLike | Storage, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of a root given as a local path, ``file://`` URL, or any URL tensorstore has a kvstore for; a
    `Storage` given as the root is that root's (another backend: it configures itself, so no `storage_options`).

    `storage_options` configure object stores (see `kvstore_spec`); unknown keys are a ValueError, and a local or
    ``memory://`` root ignores the valid ones. An object-store root is probed once here: an unreachable endpoint or refused
    credentials fail now, within the timeout, with a `StorageError`.
    """
    options = validated_options(storage_options)
    if not isinstance(root, (str, os.PathLike)) and not hasattr(root, "url"):
        raise TypeError(f"root must be a path or URL (str or os.PathLike), got {type(root).__name__} {root!r}")
    if not isinstance(root, (str, os.PathLike)):
        if options:
            raise ValueError(f"storage_options configure a root given by URL, not the Storage {root.url}")
        return root
    root = os.fspath(root)
    if not root:  # an empty variable would scatter steps into the working directory
        raise ValueError("root must be a path or URL, got ''")
    path = local_dir(root)
    if path is not None:
        return LocalStorage(path)
    _check_scheme(root)
    from .kv import KvStorage  # tensorstore (and numpy) load with the first object-store root, not with a local one

    return KvStorage(root, context(), options)


def request_error(storage: Storage, error: BaseException) -> BaseException:
    """`error` of a request tensorstore made itself through `storage.kvstore_spec` (a chunk's write), as the root's
    own requests name theirs: on an object store a `StorageError` naming the object's URL, the endpoint and what to
    check; any other error as it is (see `kv.request_error`)."""
    from .kv import request_error  # tensorstore's errors: a process that met one has loaded tensorstore already

    return request_error(storage, error)


def __getattr__(name: str) -> Any:
    """`KvStorage` loads on first use: reading a local root never imports tensorstore (nor numpy, which it imports)."""
    if name == "KvStorage":
        from .kv import KvStorage

        return KvStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
