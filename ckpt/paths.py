"""Which paths may name something inside a root: relative, '/'-separated, no '..', no absolute path.

One check for the names a manifest gives (array and pack paths) and for the paths a backend is asked for, so a
checkpoint's names can never reach outside its root.
"""

from __future__ import annotations

import re

from .errors import CorruptCheckpointError

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_%+=@,~-][A-Za-z0-9_.%+=@,~-]*\Z")


def validate_array_name(name: str) -> str:
    """`name`, once it is known to stay inside its directory; `CorruptCheckpointError` naming it otherwise."""
    segments = name.split("/")
    if not name or any(not _SEGMENT_RE.match(s) or s in (".", "..") for s in segments):
        raise CorruptCheckpointError(f"manifest names an unsafe array path {name!r}", key=name)
    return name
