"""The one place that turns a root's URL, `storage_options` and the environment (AWS variables) into a tensorstore
kvstore spec: endpoints, credentials, retries bounded by the timeout; and the tensorstore context of every root."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import fsspec

if TYPE_CHECKING:
    import tensorstore as ts

# One context per process, so that every handle of a memory:// root sees the same store. 32 concurrent
# file operations (default: a few) let the per-file fsyncs of a save overlap: ~20% faster saves here.
# Made on first use: a process that reads only local roots (the CLI) never imports tensorstore.
_CONTEXT: list[ts.Context] = []
_CONTEXT_LOCK = threading.Lock()


def context() -> ts.Context:
    """The tensorstore context shared by all roots of this process."""
    with _CONTEXT_LOCK:
        if not _CONTEXT:
            import tensorstore as ts

            _CONTEXT.append(ts.Context({"file_io_concurrency": {"limit": 32}}))
        return _CONTEXT[0]


DEFAULT_TIMEOUT_S = 30.0  # the longest any one storage operation may take (retries included) before it fails


# tensorstore's curl settings: read from the environment once per process, when its first HTTP kvstore (S3, GCS,
# HTTP) opens and makes the process's one HTTP transport; a request's own time has no other bound there.
_CURL_STALL = ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS")
_CURL_LIMIT = "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"
_HTTP_DRIVERS = ("s3", "gcs", "http")
_curl_made: list[bool] = []  # true once a root of ours made the process's HTTP transport
_curl_lock = threading.Lock()


@contextlib.contextmanager
def curl_timeouts(driver: str, timeout: float) -> Iterator[None]:
    """Around the open of the process's first object-store root: a request that moves no byte for `timeout` seconds
    (rounded up; curl's low-speed limit of 1 byte/s), or cannot connect within them, is cut and retried, so a store
    that stops answering fails a chunk write after its retries, each that long (curl's own defaults: no limit, and
    300 s to connect).

    tensorstore reads these variables once, when the first HTTP kvstore of the process opens, so the first
    object-store root's timeout holds for every later root of the process. A variable already set (the user's) is
    kept; ours are removed again once the open is done, so child processes get the environment as it was.
    """
    if driver not in _HTTP_DRIVERS:
        yield
        return
    with _curl_lock:
        if _curl_made:
            yield
            return
        seconds = str(max(1, math.ceil(timeout)))
        ours = {name: seconds for name in _CURL_STALL if name not in os.environ}
        if _CURL_LIMIT not in os.environ:
            ours[_CURL_LIMIT] = "1"
        os.environ.update(ours)
        try:
            yield
            _curl_made.append(True)
        finally:
            for name in ours:
                os.environ.pop(name, None)


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
_S3_ONLY = set(STORAGE_OPTIONS) - {"timeout"}
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def validated_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
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
        if isinstance(options.get(flag), str):  # a typo ('ture') is refused: as false it signs with other credentials
            value = _FLAGS.get(options[flag].strip().lower())
            if value is None:
                raise ValueError(
                    f"storage option {flag} is true or false (1, true, yes, on; 0, false, no, off), "
                    f"got {options[flag]!r}"
                )
            options[flag] = value
    if ("access_key_id" in options) != ("secret_access_key" in options):
        raise ValueError("storage options access_key_id and secret_access_key go together")
    return options


def retries(timeout: float) -> dict[str, Any]:
    """tensorstore's retry parameters (``*_request_retries``): 3 attempts (as the AWS SDKs' standard mode), their
    backoff under half of `timeout` (tensorstore waits min(initial * 2**attempt + jitter, max), the jitter at most
    min(1 s, initial)).

    Few attempts, because each costs a whole stall when a store stops answering: curl cuts a request only after
    `timeout` seconds without a byte (`curl_timeouts`), an upload some seconds later (curl averages its speed over
    the last seconds), and a save waits for its chunk writes' last attempt (tensorstore's default: 32 attempts).
    """
    initial = max(round(timeout / 10, 3), 0.001)  # tensorstore's durations: decimals, no exponent
    most = max(round(timeout / 4, 3), initial)
    return {"max_retries": 2, "initial_delay": f"{initial:g}s", "max_delay": f"{most:g}s"}


def kvstore_spec(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tensorstore kvstore spec of a root URL: the one place that reads storage options and AWS variables.

    ``s3://bucket/path``: endpoint, region and credentials from `storage_options`, else the standard
    variables (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID +
    AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), AWS_PROFILE, else the default AWS chain), and retries bounded
    by the timeout. ``gs://bucket/path``: tensorstore's own GCS configuration (Application Default
    Credentials) with the same bounded retries. Other URLs: as tensorstore parses them.
    """
    options = validated_options(storage_options)
    timeout = float(options.get("timeout", DEFAULT_TIMEOUT_S))
    protocol, rest = fsspec.core.split_protocol(url)
    bucket, _, path = (rest or "").partition("/")
    path = path.strip("/") + "/" if path.strip("/") else ""
    if protocol in ("s3", "gs", "gcs"):
        _check_prefix(url, path)
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
    import tensorstore as ts

    return ts.KvStore.Spec(root_url(url)).to_json()


def root_url(url: str) -> str:
    """`url` ending in one '/', the scheme's '//' kept: a bare ``rstrip`` made ``s3://`` ``s3:/``, which tensorstore
    failed to parse ("Scheme "s3://" not present"), so a missing bucket went unnamed and ``memory://`` did not open."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rstrip("/") + "/"
    return scheme + sep + (rest.rstrip("/") + "/" if rest.strip("/") else "")


_UNPLAIN = ("", ".", "..")  # the key segments that stores and HTTP clients resolve as a path's


def plain_key(key: str) -> bool:
    """Whether an object key has no empty, '.' or '..' segment: a request addresses that key and no other."""
    return not any(segment in _UNPLAIN for segment in key.split("/"))


def _check_prefix(url: str, path: str) -> None:
    """Refuse a root whose key prefix has an empty, '.' or '..' segment (``s3://b/x//y``, ``s3://b/x/../y``).

    Object keys are not paths, but stores and HTTP clients treat such keys as paths, each its own way: SeaweedFS
    stores ``x//y/k`` as ``x/y/k`` yet lists nothing under ``x//y/`` (every save succeeds, and no step is ever seen:
    a resumed run starts afresh), and curl resolves ``..`` after the request was signed (refused as bad
    credentials). The URL is refused here, naming the segment, before any request."""
    for segment in path.rstrip("/").split("/") if path else ():
        if segment in _UNPLAIN:
            raise ValueError(
                f"{url}: an object-store root's path may not have {'an empty' if not segment else 'a ' + repr(segment)}"
                " segment (keys are not paths: stores and HTTP clients resolve '//', '.' and '..' each their own way)"
            )


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
    keeps the default chain from printing errors about a missing ~/.aws/config. AWS_ACCESS_KEY_ID without
    AWS_SECRET_ACCESS_KEY is a ValueError, as botocore's PartialCredentialsError (a secret alone is passed over)."""
    env = os.environ
    if options.get("anonymous"):
        return {"type": "anonymous"}
    if "access_key_id" in options:
        return _static_credentials(
            str(options["access_key_id"]), str(options["secret_access_key"]), options.get("session_token")
        )
    if options.get("profile"):
        return {"type": "profile", "profile": str(options["profile"])}
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return {"type": "environment"}  # AWS_SESSION_TOKEN too
    if key:  # the default chain would go on to files and instance metadata, then send unsigned requests
        raise ValueError(
            "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not: set both (as the AWS SDKs require), or unset "
            "AWS_ACCESS_KEY_ID to use AWS_PROFILE or the default chain, or give storage_options access_key_id and "
            "secret_access_key"
        )
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
