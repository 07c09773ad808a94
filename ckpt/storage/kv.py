"""A root in any tensorstore kvstore (memory, GCS, S3, HTTP...), addressed by URL; every request bounded by a timeout.

The same kvstore writes the arrays (`kvstore_spec`), so a root is never read through one store and written through
another. On object stores a single PUT of the manifest is the atomic commit.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from typing import Any, Mapping

import tensorstore as ts

from ..errors import StorageError
from .local import too_big
from .protocol import Storage, checked
from .spec import DEFAULT_TIMEOUT_S, curl_timeouts, kvstore_spec, plain_key, root_url, validated_options

log = logging.getLogger(__name__)
_REMOTE = ("s3", "gcs")  # drivers probed when a root is opened
_PROBE = ".ckpt-probe"  # a prefix listed once when a root is opened (one LIST, nothing written)


class KvStorage:
    """A root in any tensorstore kvstore (memory, GCS, S3, HTTP...), addressed by URL.

    Every operation is bounded: it fails within the root's timeout (`storage_options`, default 30 s) with a
    `StorageError` that names the root, the endpoint and what to check, never hangs.
    """

    cheap_sizes = False
    lease_kind = "conditional"

    def __init__(self, url: str, context: ts.Context, storage_options: Mapping[str, Any] | None = None):
        self.url = root_url(url)
        options = validated_options(storage_options)
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
        self._base = kvstore_spec(self.url, options)
        self.keeps_written_buffers = self._base["driver"] == "memory"
        self.endpoint = self._base.get("endpoint")
        self.bucket = self._base.get("bucket")
        with curl_timeouts(self._base["driver"], self.timeout):  # the first one: its timeout bounds curl's stalls
            self._kv = self._wait(ts.KvStore.open(self._base, context=context), "open")
        if self._base["driver"] in _REMOTE:  # reachable, credentials accepted, bucket there: fail here, not later
            self._wait(self._kv.list(ts.KvStore.KeyRange(_PROBE, _PROBE + "\x00")), "list", _PROBE)

    def kvstore_spec(self, path: str) -> dict[str, Any]:
        spec = dict(self._base)
        spec["path"] = spec.get("path", "") + (checked(path).rstrip("/") + "/" if path else "")
        return spec

    def local_path(self, path: str) -> str | None:
        return None

    def direct_path(self, path: str) -> str | None:
        return None

    def check_root(self) -> None:
        """Any prefix of a store is a root (an empty one until written); `__init__` probed a remote one."""

    def check_creatable(self) -> None:
        """A prefix is made by its first write; `__init__` probed that the store answers."""

    def _wait(self, future: Any, what: str, key: str = "", timeout: float | None = None) -> Any:
        """The future's result within the root's timeout (or `timeout`, when shorter); any failure becomes a
        `StorageError` saying what to check."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            return future.result(timeout=timeout)
        except TimeoutError as e:
            future.cancel()
            raise self._error(what, key, f"no answer within {timeout:g} s", e) from e
        except (ValueError, OSError, RuntimeError) as e:  # tensorstore's error statuses
            raise self._error(what, key, str(e), e) from e

    def _error(self, what: str, key: str, detail: str, cause: BaseException) -> StorageError:
        return _storage_error(self.url, self.endpoint, self.bucket, what, key, detail, cause)

    def _keys(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff") if prefix else ts.KvStore.KeyRange()
        return sorted(k.decode() for k in self._wait(self._kv.list(rng), "list", prefix))

    def list_dirs(self, path: str = "") -> list[str]:
        prefix = checked(path).rstrip("/") + "/" if path else ""
        return sorted({k[len(prefix) :].split("/", 1)[0] for k in self._keys(prefix) if "/" in k[len(prefix) :]})

    def list_files(self, path: str) -> list[str]:
        prefix = checked(path).rstrip("/") + "/"
        return [k[len(prefix) :] for k in self._keys(prefix)]

    def read(self, path: str, limit: int | None = None) -> bytes | None:
        r = self._wait(self._kv.read(checked(path)), "read", path)
        if r.state != "value":
            return None
        too_big(len(r.value), limit, self.url + path)  # read already: an object's bytes were paid to upload
        return r.value

    def read_range(self, path: str, start: int, stop: int | None) -> bytes | None:
        """One ranged GET. A range past the object's end is refused (OUT_OF_RANGE): then its tail from `start`
        (shorter than asked), or nothing when it ends before `start`."""
        for tail in (slice(start, stop), slice(start, None)):
            try:
                r = self._wait(self._kv.read(checked(path), byte_range=tail), "read", path)
                return r.value if r.state == "value" else None
            except StorageError as e:
                if "OUT_OF_RANGE" not in str(e):
                    raise
        return b"" if self.read_range(path, 0, 0) is not None else None

    def write_atomic(self, path: str, data: bytes) -> None:
        """One PUT: on an object store the object appears whole or not at all (see docs/object_stores.md)."""
        self._wait(self._kv.write(checked(path), data), "write", path)

    def create(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """One PUT that succeeds only if the key is absent (S3 ``If-None-Match: *``, a GCS generation precondition);
        `FileExistsError` when it exists. Fails with a `StorageError` after `timeout` seconds (at most the root's)."""
        end = None if timeout is None else time.monotonic() + timeout
        present, absent = self.read_versioned(path, timeout)  # the generation of a missing key, for the condition
        left = None if end is None else max(end - time.monotonic(), 0.001)
        if present is not None or self.write_if(path, data, absent, left) is None:
            raise FileExistsError(errno.EEXIST, "already exists", f"{self.url}{path}")

    def delete_tree(self, path: str) -> None:
        prefix = checked(path).rstrip("/") + "/"
        self._wait(self._kv.delete_range(ts.KvStore.KeyRange(prefix, prefix + "\xff")), "delete", prefix)

    def delete_file(self, path: str) -> None:
        self._delete_key(checked(path))

    def _delete_key(self, key: str) -> None:
        """One DELETE of the object `key`, as listed (a key no checkpoint writes, `.DS_Store`, too)."""
        self._wait(self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\x00")), "delete", key)

    def move_tree(self, src: str, dst: str) -> None:
        """Copy every key under `src` to `dst`, then delete `src` (object stores have no rename): the keys right under
        it first, then the rest, so that a step moved aside stops being committed (its manifest goes first, as
        `catalog.delete_step` orders it) before any of its files goes; a delete cut short leaves an uncommitted
        leftover for gc, not a committed step missing files that blocks the next save of its number.

        The keys are the listing's, moved as they are (under `src`, so inside the root): an object no checkpoint
        writes (`.DS_Store`, `notes (1).txt`) moves with the rest, as a rename moves it on a local root, instead of
        failing the move as an unsafe path (which failed the restore that quarantined a damaged step). A key with an
        empty, '.' or '..' segment, which no request addresses as written, is not copied (a warning names it)."""
        source, target = checked(src).rstrip("/") + "/", checked(dst).rstrip("/") + "/"
        keys = self.list_files(src)
        for k in keys:
            if not plain_key(k):
                log.warning(
                    "%s%s%s is not copied to %s: a key with an empty, '.' or '..' segment", self.url, source, k, target
                )
                continue
            r = self._wait(self._kv.read(source + k), "read", source + k)
            if r.state == "value":
                self._wait(self._kv.write(target + k, r.value), "write", target + k)
        for k in keys:
            if "/" not in k and plain_key(k):
                self._delete_key(source + k)
        self.delete_tree(src)

    def size(self, path: str) -> int:
        """Bytes under `path`: every object is read (an object store lists no sizes here), so it costs a GET each."""
        return sum(len(self.read(f"{path.rstrip('/')}/{k}") or b"") for k in self.list_files(path))

    def sync_tree(self, path: str) -> None:
        """Nothing to do: an object store has no directory entries, and each PUT is durable when it returns."""

    def read_versioned(self, path: str, timeout: float | None = None) -> tuple[bytes | None, bytes]:
        """A key's value (None when absent) and its storage generation, for a later `write_if`."""
        r = self._wait(self._kv.read(checked(path)), "read", path, timeout)
        return (r.value if r.state == "value" else None), r.stamp.generation

    def write_if(self, path: str, data: bytes | None, generation: bytes, timeout: float | None = None) -> bytes | None:
        """Write (or delete, with None) only if the key is still at `generation` (as read; absent included).

        Returns the new generation, or None when another writer changed the key first (nothing written). The
        condition is checked by the store itself (see `_s3_spec`: conditional writes), never by a read before.
        """
        stamp = self._wait(self._kv.write(checked(path), data, if_equal=generation), "write", path, timeout)
        return stamp.generation or None


def _storage_error(
    url: str, endpoint: str | None, bucket: str | None, what: str, key: str, detail: str, cause: BaseException
) -> StorageError:
    """The error of a failed request to the root `url`, naming the object, endpoint and bucket, and what to check."""
    server = f"endpoint {endpoint}" if endpoint else "the provider's default endpoint"
    first = detail.splitlines()[0][:300] if detail else type(cause).__name__
    message = f"{what} {url}{key} failed ({server}, bucket {bucket!r}): {_hint(detail, bucket)}; {first}"
    return StorageError(message, url=url, endpoint=endpoint, bucket=bucket, key=key)


_STATUS = re.compile(r"[A-Z][A-Z_]+: ")  # tensorstore's error text: its status code first
_REQUEST = re.compile(r'Error (writing|reading|deleting|listing) "([^"]*)"')  # ... then the request that failed
_SPEC = " [tensorstore_spec="  # ... then the whole spec, whose words ("credentials") are no answer of the store


def request_error(storage: Storage, error: BaseException) -> BaseException:
    """`error` of a request tensorstore made itself through `storage.kvstore_spec` (a chunk's write, an array's
    creation), in the words of this module's own requests: a `StorageError` naming the object's URL, the endpoint,
    the bucket and what to check, where the request went to an object store (S3, GCS).

    tensorstore names only the key inside the bucket (``Error writing "run/step_2/.../c/0": ... CURL error``): no URL,
    no endpoint, no word that the endpoint cannot be reached. Any other error is returned as it is: a local root's
    (its message names the file), ours, and one naming no key under this root (a local tier's read while persisting).
    """
    if isinstance(error, StorageError) or not isinstance(error, (ValueError, OSError, RuntimeError)):
        return error
    detail = str(error).split(_SPEC, 1)[0]
    spec = storage.kvstore_spec("")
    if spec.get("driver") not in _REMOTE or not _STATUS.match(detail):
        return error
    prefix = spec.get("path", "")
    found = [(v, k) for v, k in _REQUEST.findall(detail) if k.startswith(prefix) and not k.startswith("/")]
    if not found:
        return error
    verb, key = found[0]
    what = {"writing": "write", "reading": "read", "deleting": "delete", "listing": "list"}[verb]
    endpoint, bucket = spec.get("endpoint"), spec.get("bucket")
    failed = _storage_error(storage.url, endpoint, bucket, what, key[len(prefix) :], detail, error)
    failed.__cause__ = error
    return failed


_REFUSED = ("permission_denied", "unauthenticated", "response_code='403'", "signaturedoesnotmatch", "accessdenied")
_REFUSED += ("invalidaccesskeyid", "credentials")
_UNREACHABLE = ("curl error", "could not connect", "couldn't connect", "resolve host", "timed out", "no answer within")


def _hint(detail: str, bucket: str | None) -> str:
    """What a user should check, from the store's answer."""
    text = detail.lower()
    if any(s in text for s in _REFUSED):
        return (
            "the store refused the credentials: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
            "AWS_SESSION_TOKEN / AWS_PROFILE or storage_options"
        )
    if "nosuchbucket" in text or ("not_found" in text and "bucket" in text):
        return f"bucket {bucket!r} does not exist: create it or fix the root's URL"
    if any(s in text for s in _UNREACHABLE):
        return (
            "the endpoint cannot be reached: check AWS_ENDPOINT_URL / storage_options['endpoint'], the "
            "network, and that the server is up"
        )
    return "check the server's health, the endpoint, the credentials and the bucket"
