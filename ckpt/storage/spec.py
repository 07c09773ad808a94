"""The one place that turns a root's URL, `storage_options` and the environment (AWS variables) into a tensorstore
kvstore spec: endpoints, credentials, retries bounded by the timeout; and the tensorstore context of every root."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Mapping

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
_S3_ONLY = set(STORAGE_OPTIONS) - {"timeout"}
_TRUE = ("1", "true", "yes", "on")


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
    options = validated_options(storage_options)
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
    import tensorstore as ts

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
