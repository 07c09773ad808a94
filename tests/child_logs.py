"""Waiting on the log a child process of the lease, gc and crash tests appends to, one line per event."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for(path: Path, text: str, timeout: float = 120.0, process=None) -> str:
    """The log's content once it contains `text`; fails after `timeout`, or as soon as `process` (if given) died."""
    deadline = time.monotonic() + timeout
    while True:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        assert process is None or process.is_alive(), f"{path}: the process died before saying {text!r}: {content!r}"
        assert time.monotonic() < deadline, f"{path} never said {text!r}: {content or '(no file)'}"
        time.sleep(0.02)
