"""The command-line form of a root's storage options (`--endpoint`, `--region`, `--timeout`,
`--storage-option KEY=VALUE`), shared by `python -m ckpt` and `python -m ettr` so both name and read them alike;
`storage/spec.py` validates the options themselves."""

from __future__ import annotations

import argparse

from .storage import STORAGE_OPTIONS


def _storage_option(text: str) -> tuple[str, str]:
    """An argparse type: KEY=VALUE."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def parser() -> argparse.ArgumentParser:
    """A parent parser with the object-store options (s3://, gs://); the AWS variables apply without them."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("object stores (s3://, gs://; default: the standard AWS_* variables)")
    g.add_argument("--endpoint", help="S3 endpoint URL, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL)")
    g.add_argument("--region", help="S3 region (default: AWS_REGION)")
    g.add_argument("--timeout", type=float, help="seconds one storage request may take, retries included (default 30)")
    g.add_argument(
        "--storage-option",
        dest="options",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help=f"any storage option ({', '.join(STORAGE_OPTIONS)}); repeatable",
    )
    return p


def options(args: argparse.Namespace) -> dict[str, object]:
    """The storage options given on the command line (empty: none, the environment alone)."""
    out: dict[str, object] = dict(args.options)
    for key in ("endpoint", "region", "timeout"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    return out
