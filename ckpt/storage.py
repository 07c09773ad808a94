"""Where a checkpoint root lives: small files, listing and deletion, and the tensorstore kvstore spec.

One root is always accessed through one store: a local directory through the OS (atomic rename +
fsync for the commit), anything else (``memory://``, ``gs://``, ``s3://`` ...) through tensorstore's own
kvstore, which also writes the arrays — so a root is never read through one store and written through
another (fsspec's ``memory://`` and tensorstore's ``memory`` are different stores). On object stores a
single PUT of the manifest is the atomic commit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Protocol

import fsspec
import tensorstore as ts

from .budget import submit_or_run
from .errors import StorageError
from .format import validate_array_name


class Storage(Protocol):
    """The operations the checkpointer needs from a root."""

    url: str

    def kvstore_spec(self, path: str) -> dict[str, Any]: ...
    def local_path(self, path: str) -> str | None: ...
    def list_dirs(self, path: str = "") -> list[str]: ...
    def list_files(self, path: str) -> list[str]: ...
    def read(self, path: str) -> bytes | None: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def create(self, path: str, data: bytes, timeout: float | None = None) -> None: ...
    def delete_tree(self, path: str) -> None: ...
    def delete_file(self, path: str) -> None: ...
    def move_tree(self, src: str, dst: str) -> None: ...
    def size(self, path: str) -> int: ...
    def sync_tree(self, path: str) -> None: ...


def _check(path: str) -> str:
    validate_array_name(path)
    return path


def where(storage: Storage, path: str) -> str:
    """A path of a root as a user finds it: the local file, or the URL."""
    return storage.local_path(path) or f"{storage.url}{path}"


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
    (the directory itself included) that is neither a regular file nor a directory."""
    sizes: dict[str, int] = {}
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(errno.EINVAL, _kind(mode), path)
    stack = [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode):
                    sizes[os.path.relpath(e.path, path)] = st.st_size
                else:
                    raise UnsafeFileError(errno.EINVAL, _kind(st.st_mode), e.path)
    return sizes


class LocalStorage:
    """A root on a local (POSIX) filesystem."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, _check(path)) if path else self.root

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        return {"driver": "file", "path": self._p(path).rstrip("/") + "/"}

    def local_path(self, path: str) -> str | None:
        return self._p(path)

    def list_dirs(self, path: str = "") -> list[str]:
        base = self._p(path)
        if not os.path.isdir(base):
            return []
        return sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))

    def list_files(self, path: str) -> list[str]:
        base = self._p(path)
        return sorted(os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base) for f in fs)

    def read(self, path: str) -> bytes | None:
        """The file's bytes, None when it is missing; UnsafeFileError when it is not a regular file."""
        try:
            fd = open_regular(self._p(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        with open(fd, "rb") as f:
            return f.read()

    def _durable_temp(self, path: str, data: bytes) -> tuple[str, str]:
        """`data` in a fsync'd temp file beside `path` (its directory made durably); returns (temp, final)."""
        final = self._p(path)
        makedirs_durable(os.path.dirname(final))
        tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp, final

    def write_atomic(self, path: str, data: bytes) -> None:
        """temp file + fsync + rename + fsync of the directory: the file is either whole or absent."""
        tmp, final = self._durable_temp(path, data)
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a file that does not exist yet, whole or not at all; `FileExistsError` (nothing written) when it
        does: temp file + fsync, then a hard link, which never replaces an existing file (a rename would).

        `timeout` is for stores whose requests can hang; a local write has none.
        """
        tmp, final = self._durable_temp(path, data)
        try:
            os.link(tmp, final)
        finally:
            os.remove(tmp)
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
        base = self._p(path)
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs)

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


class KvStorage:
    """A root in any tensorstore kvstore (memory, GCS, S3, HTTP...), addressed by URL.

    Every operation is bounded: it fails within the root's timeout (`storage_options`, default 30 s) with a
    `StorageError` that names the root, the endpoint and what to check, never hangs.
    """

    def __init__(self, url: str, context: ts.Context, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/") + "/"
        options = _options(storage_options)
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
        self._base = kvstore_spec(self.url, options)
        self.endpoint = self._base.get("endpoint")
        self.bucket = self._base.get("bucket")
        self._kv = self._wait(ts.KvStore.open(self._base, context=context), "open")
        if self._base["driver"] in _REMOTE:  # reachable, credentials accepted, bucket there: fail here, not later
            self._wait(self._kv.list(ts.KvStore.KeyRange(_PROBE, _PROBE + "\x00")), "list", _PROBE)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        spec = dict(self._base)
        spec["path"] = spec.get("path", "") + (_check(path).rstrip("/") + "/" if path else "")
        return spec

    def local_path(self, path: str) -> str | None:
        return None

    def _wait(self, future: Any, what: str, key: str = "", timeout: float | None = None) -> Any:
        """The future's result within the root's timeout (or `timeout`, when shorter); any failure becomes a
        `StorageError` saying what to check."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            return future.result(timeout=timeout)
        except TimeoutError as e:
            future.cancel()
            raise _storage_error(self, what, key, f"no answer within {timeout:g} s", e) from e
        except (ValueError, OSError, RuntimeError) as e:  # tensorstore's error statuses
            raise _storage_error(self, what, key, str(e), e) from e

    def _keys(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff") if prefix else ts.KvStore.KeyRange()
        return sorted(k.decode() for k in self._wait(self._kv.list(rng), "list", prefix))

    def list_dirs(self, path: str = "") -> list[str]:
        prefix = _check(path).rstrip("/") + "/" if path else ""
        return sorted({k[len(prefix) :].split("/", 1)[0] for k in self._keys(prefix) if "/" in k[len(prefix) :]})

    def list_files(self, path: str) -> list[str]:
        prefix = _check(path).rstrip("/") + "/"
        return [k[len(prefix) :] for k in self._keys(prefix)]

    def read(self, path: str) -> bytes | None:
        r = self._wait(self._kv.read(_check(path)), "read", path)
        return r.value if r.state == "value" else None

    def write_atomic(self, path: str, data: bytes) -> None:
        """One PUT: on an object store the object appears whole or not at all (see docs/object_stores.md)."""
        self._wait(self._kv.write(_check(path), data), "write", path)

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """One PUT that succeeds only if the key is absent (S3 ``If-None-Match: *``, a GCS generation precondition);
        `FileExistsError` when it exists. Fails with a `StorageError` after `timeout` seconds (at most the root's)."""
        end = None if timeout is None else time.monotonic() + timeout
        present, absent = self.read_versioned(path, timeout)  # the generation of a missing key, for the condition
        left = None if end is None else max(end - time.monotonic(), 0.001)
        if present is not None or self.write_if(path, data, absent, left) is None:
            raise FileExistsError(errno.EEXIST, "already exists", f"{self.url}{path}")

    def delete_tree(self, path: str) -> None:
        prefix = _check(path).rstrip("/") + "/"
        self._wait(self._kv.delete_range(ts.KvStore.KeyRange(prefix, prefix + "\xff")), "delete", prefix)

    def delete_file(self, path: str) -> None:
        self._wait(self._kv.delete_range(ts.KvStore.KeyRange(_check(path), _check(path) + "\x00")), "delete", path)

    def move_tree(self, src: str, dst: str) -> None:
        """Copy every key under `src` to `dst`, then delete `src` (object stores have no rename)."""
        for k in self.list_files(src):
            data = self.read(f"{src}/{k}")
            if data is not None:
                self.write_atomic(f"{dst}/{k}", data)
        self.delete_tree(src)

    def size(self, path: str) -> int:
        """Bytes under `path`: every object is read (an object store lists no sizes here), so it costs a GET each."""
        return sum(len(self.read(f"{path.rstrip('/')}/{k}") or b"") for k in self.list_files(path))

    def sync_tree(self, path: str) -> None:
        """Nothing to do: an object store has no directory entries, and each PUT is durable when it returns."""

    def read_versioned(self, path: str, timeout: float | None = None) -> tuple[bytes | None, bytes]:
        """A key's value (None when absent) and its storage generation, for a later `write_if`."""
        r = self._wait(self._kv.read(_check(path)), "read", path, timeout)
        return (r.value if r.state == "value" else None), r.stamp.generation

    def write_if(self, path: str, data: bytes | None, generation: bytes, timeout: float | None = None) -> bytes | None:
        """Write (or delete, with None) only if the key is still at `generation` (as read; absent included).

        Returns the new generation, or None when another writer changed the key first (nothing written). The
        condition is checked by the store itself (see `_s3_spec`: conditional writes), never by a read before.
        """
        stamp = self._wait(self._kv.write(_check(path), data, if_equal=generation), "write", path, timeout)
        return stamp.generation or None


def _storage_error(storage: KvStorage, what: str, key: str, detail: str, cause: BaseException) -> StorageError:
    """The error of a failed request, naming the root, endpoint and bucket, and what to check."""
    server = f"endpoint {storage.endpoint}" if storage.endpoint else "the provider's default endpoint"
    first = detail.splitlines()[0][:300] if detail else type(cause).__name__
    message = (
        f"{what} {storage.url}{key} failed ({server}, bucket {storage.bucket!r}): {_hint(detail, storage)}; {first}"
    )
    return StorageError(message, url=storage.url, endpoint=storage.endpoint, bucket=storage.bucket, key=key)


_REFUSED = ("permission_denied", "unauthenticated", "response_code='403'", "signaturedoesnotmatch", "accessdenied")
_REFUSED += ("invalidaccesskeyid", "credentials")
_UNREACHABLE = ("curl error", "could not connect", "couldn't connect", "resolve host", "timed out", "no answer within")


def _hint(detail: str, storage: KvStorage) -> str:
    """What a user should check, from the store's answer."""
    text = detail.lower()
    if any(s in text for s in _REFUSED):
        return (
            "the store refused the credentials: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
            "AWS_SESSION_TOKEN / AWS_PROFILE or storage_options"
        )
    if "nosuchbucket" in text or ("not_found" in text and "bucket" in text):
        return f"bucket {storage.bucket!r} does not exist: create it or fix the root's URL"
    if any(s in text for s in _UNREACHABLE):
        return (
            "the endpoint cannot be reached: check AWS_ENDPOINT_URL / storage_options['endpoint'], the "
            "network, and that the server is up"
        )
    return "check the server's health, the endpoint, the credentials and the bucket"


# One context per process, so that every handle of a memory:// root sees the same store. 32 concurrent
# file operations (default: a few) let the per-file fsyncs of a save overlap: ~20% faster saves here.
_CONTEXT = ts.Context({"file_io_concurrency": {"limit": 32}})


def open_storage(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of a root given as a local path, ``file://`` URL, or any URL tensorstore has a kvstore for.

    `storage_options` configure object stores (see `kvstore_spec`); unknown keys are a ValueError, and a local or
    ``memory://`` root ignores the valid ones. An object-store root is probed once here: an unreachable endpoint or refused
    credentials fail now, within the timeout, with a `StorageError`.
    """
    root = os.fspath(root)
    options = _options(storage_options)
    protocol, path = fsspec.core.split_protocol(root)
    if protocol in (None, "file", "local"):
        return LocalStorage(path)
    return KvStorage(root, _CONTEXT, options)


def context() -> ts.Context:
    """The tensorstore context shared by all roots of this process."""
    return _CONTEXT


# -- object stores: the one place that turns a URL, storage_options and the environment into a kvstore spec --------

DEFAULT_TIMEOUT_S = 30.0  # the longest any one storage operation may take (retries included) before it fails


def _curl_defaults() -> None:
    """A request that moves no byte for 30 s, or cannot connect within 30 s, is cut and retried (bounded retries).

    Without these, a server that accepts a connection and never answers stalls an array write forever (curl's
    defaults: no low-speed limit, 300 s to connect). tensorstore reads them once, at its first HTTP request; a
    user's own values win.
    """
    for name, value in (
        ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "30"),
        ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1"),
        ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", "30"),
    ):
        os.environ.setdefault(name, value)


_curl_defaults()

STORAGE_OPTIONS = {
    "endpoint": "S3 endpoint URL (default: AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then AWS itself)",
    "region": "S3 region used in request signatures (default: AWS_REGION, then AWS_DEFAULT_REGION)",
    "access_key_id": "S3 access key (with secret_access_key; default: AWS_ACCESS_KEY_ID)",
    "secret_access_key": "S3 secret key (default: AWS_SECRET_ACCESS_KEY)",
    "session_token": "S3 session token of temporary credentials (default: AWS_SESSION_TOKEN)",
    "profile": "a profile of ~/.aws/credentials and ~/.aws/config (default: AWS_PROFILE)",
    "anonymous": "true: unsigned requests (public buckets)",
    "requester_pays": "true: allow requests to a requester-pays bucket",
    "host_header": "S3 Host header to send instead of the endpoint's host",
    "timeout": f"seconds one storage operation may take, retries included, before it fails (default {DEFAULT_TIMEOUT_S:g})",
}
_REMOTE = ("s3", "gcs")
_PROBE = ".ckpt-probe"  # a prefix listed once when a root is opened (one LIST, nothing written)
_S3_ONLY = set(STORAGE_OPTIONS) - {"timeout"}
_TRUE = ("1", "true", "yes", "on")


def _options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validated storage options: known keys, typed values (strings from a command line are accepted)."""
    options = dict(storage_options or {})
    unknown = sorted(set(options) - set(STORAGE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown storage option(s) {', '.join(unknown)}; known: {', '.join(STORAGE_OPTIONS)}")
    if "timeout" in options:
        try:
            options["timeout"] = float(options["timeout"])
        except (TypeError, ValueError):
            raise ValueError(
                f"storage option timeout must be a number of seconds, got {options['timeout']!r}"
            ) from None
        if not 0 < options["timeout"] < 1e6:
            raise ValueError(f"storage option timeout must be positive seconds, got {options['timeout']!r}")
    for flag in ("anonymous", "requester_pays"):
        if isinstance(options.get(flag), str):
            options[flag] = options[flag].lower() in _TRUE
    if ("access_key_id" in options) != ("secret_access_key" in options):
        raise ValueError("storage options access_key_id and secret_access_key go together")
    return options


def retries(timeout: float) -> dict[str, Any]:
    """tensorstore's retry parameters (``*_request_retries``) whose exponential backoff fits in `timeout` seconds.

    tensorstore waits min(initial * 2**attempt + jitter, max) between attempts; we keep the sum of the waits
    under half the timeout, so that the requests themselves have the other half.
    """
    initial, most = min(1.0, timeout / 100), min(32.0, max(timeout / 8, 0.05))
    attempts, waited = 1, 0.0
    while attempts < 32:
        wait = min(initial * 2 ** (attempts - 1) * 1.5, most)  # 1.5: room for the jitter
        if waited + wait > timeout / 2:
            break
        waited += wait
        attempts += 1
    return {"max_retries": attempts, "initial_delay": f"{initial:g}s", "max_delay": f"{most:g}s"}


def kvstore_spec(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tensorstore kvstore spec of a root URL: the one place that reads storage options and AWS variables.

    ``s3://bucket/path``: endpoint, region and credentials from `storage_options`, else the standard
    variables (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID +
    AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), AWS_PROFILE, else the default AWS chain), and retries bounded
    by the timeout. ``gs://bucket/path``: tensorstore's own GCS configuration (Application Default
    Credentials) with the same bounded retries. Other URLs: as tensorstore parses them.
    """
    options = _options(storage_options)
    timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
    protocol, rest = fsspec.core.split_protocol(url)
    bucket, _, path = (rest or "").partition("/")
    path = path.strip("/") + "/" if path.strip("/") else ""
    if protocol == "s3":
        if not bucket:
            raise ValueError(f"{url}: an s3:// root names a bucket (s3://bucket/path)")
        return _s3_spec(bucket, path, options, timeout)
    if protocol in ("gs", "gcs"):
        s3_only = sorted(_S3_ONLY & set(options))
        if s3_only:  # GCS is configured through tensorstore's own variables: an S3 option here is a mistake
            raise ValueError(f"storage option(s) {', '.join(s3_only)} apply to s3:// roots only, not {url}")
        if not bucket:
            raise ValueError(f"{url}: a gs:// root names a bucket (gs://bucket/path)")
        return {"driver": "gcs", "bucket": bucket, "path": path, "gcs_request_retries": retries(timeout)}
    return ts.KvStore.Spec(url.rstrip("/") + "/").to_json()


def _s3_spec(bucket: str, path: str, options: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    env = os.environ
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    endpoint = options.get("endpoint") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        if not str(endpoint).startswith(("http://", "https://")):
            raise ValueError(f"S3 endpoint must be an http:// or https:// URL, got {endpoint!r}")
        spec["endpoint"] = str(endpoint).rstrip("/")
    region = options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = str(region)
    elif endpoint:
        spec["aws_region"] = "us-east-1"  # S3-compatible servers sign with any region; AWS's default one
    if options.get("host_header"):
        spec["host_header"] = str(options["host_header"])
    if options.get("requester_pays"):
        spec["requester_pays"] = True
    # The store checks a write's condition itself (If-Match / If-None-Match): the lease's renewals and the
    # manifest's create-if-absent are atomic. Without this, tensorstore checks with a HEAD first, then PUTs
    # unconditionally, for any endpoint but AWS's own, and two writers can both win.
    spec["use_conditional_write"] = True
    spec["aws_credentials"] = _aws_credentials(options)
    spec["s3_request_retries"] = retries(timeout)
    return spec


def _aws_credentials(options: Mapping[str, Any]) -> dict[str, Any]:
    """Which credentials sign the requests, in the AWS SDKs' order: explicit keys, a named profile, the key
    variables, AWS_PROFILE, then the default chain (files, ECS, instance metadata). Naming the source also
    keeps the default chain from printing errors about a missing ~/.aws/config."""
    env = os.environ
    if options.get("anonymous"):
        return {"type": "anonymous"}
    if "access_key_id" in options:
        return _static_credentials(
            str(options["access_key_id"]), str(options["secret_access_key"]), options.get("session_token")
        )
    if options.get("profile"):
        return {"type": "profile", "profile": str(options["profile"])}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}  # AWS_SESSION_TOKEN too
    if env.get("AWS_PROFILE"):
        return {"type": "profile", "profile": env["AWS_PROFILE"]}
    return {"type": "default"}


_static_files: dict[tuple[str, str, str | None], dict[str, Any]] = {}
_static_lock = threading.Lock()


def _static_credentials(key: str, secret: str, token: Any) -> dict[str, Any]:
    """Explicit keys as tensorstore takes them: a private credentials file (mode 0600 in a 0700 directory,
    removed at exit), since its S3 driver has no inline-keys provider."""
    token = str(token) if token else None
    with _static_lock:
        found = _static_files.get((key, secret, token))
        if found is None:
            folder = tempfile.mkdtemp(prefix="ckpt-aws-")
            atexit.register(shutil.rmtree, folder, True)
            creds, config = os.path.join(folder, "credentials"), os.path.join(folder, "config")
            lines = ["[ckpt]", f"aws_access_key_id = {key}", f"aws_secret_access_key = {secret}"]
            lines += [f"aws_session_token = {token}"] if token else []
            for name, text in ((creds, "\n".join(lines) + "\n"), (config, "[profile ckpt]\n")):
                with open(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    f.write(text)
            found = {"type": "profile", "profile": "ckpt", "credentials_file": creds, "config_file": config}
            _static_files[(key, secret, token)] = found
        return dict(found)
