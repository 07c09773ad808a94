"""A real text corpus present on every machine: the bytes of the Python standard library's own .py files."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in a fixed (sorted, depth-first) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    return files


def write_corpus(path: Path, max_bytes: int) -> int:
    """Concatenate standard-library sources into `path` (one byte = one token) up to `max_bytes`; returns its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with open(path, "wb") as out:
        for source in stdlib_sources():
            data = source.read_bytes()[: max_bytes - size]
            out.write(data)
            size += len(data)
            if size >= max_bytes:
                break
    return size
