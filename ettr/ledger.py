"""Append-only JSON-lines ledger per process attempt under ROOT/ettr/, readable after a SIGKILL."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

LEDGER_DIR = "ettr"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ledger-(?P<attempt>.+)-rank(?P<rank>\d+)(?:\.(?P<seg>\d{6}))?\.jsonl$")
# Fields every record of a kind must carry; unknown kinds are skipped so newer writers stay readable.
REQUIRED: dict[str, tuple[str, ...]] = {
    "start": ("t", "job", "attempt", "rank"),
    "step": ("s", "b", "e", "o"),
    "span": ("c", "b", "e", "o"),
    "alive": ("t", "open"),
    "commit": ("s", "t", "bg"),
    "restore": ("s", "t"),
    "ckpt_failed": ("s", "t", "err"),
    "end": ("t", "status"),
}


# Where a commit or restore record's optional `tier` says the checkpoint went or came from (absent: one tier).
TIERS = ("local", "peer", "durable")
_INT, _NUM, _STR = "an integer", "a number", "a string"
# The type of every field attribution reads; a line with another type is an error naming its file and line.
FIELD_TYPES: dict[str, str] = {
    "t": _INT,
    "b": _INT,
    "e": _INT,
    "o": _INT,
    "rank": _INT,
    "s": _INT,
    "bg": _NUM,
    "c": _STR,
    "job": _STR,
    "attempt": _STR,
    "status": _STR,
    "err": _STR,
}


def _has_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, {_INT: int, _NUM: (int, float), _STR: str}[kind])


class LedgerError(ValueError):
    """A ledger that cannot be read; the message names the file and line."""


def ledger_dir(root: str) -> str:
    """The folder holding the ledgers of a checkpoint root."""
    return root.rstrip("/") + "/" + LEDGER_DIR


class LedgerWriter:
    """Appends whole lines: each `append` reaches the OS at once on local disks, `sync` makes them durable.

    Locally a line handed to the kernel with one write(2) survives a SIGKILL of the process (not a power loss,
    which `sync`'s fsync covers). Object stores cannot append: there lines wait in memory and each `sync` is a
    single PUT of a new numbered segment (atomic, never torn).
    """

    def __init__(self, root: str, attempt: str, rank: int, storage_options: dict[str, Any] | None = None) -> None:
        self._fs, base = fsspec.core.url_to_fs(ledger_dir(root), **(storage_options or {}))
        self._fs.makedirs(base, exist_ok=True)
        self._stem = f"{base}/ledger-{attempt}-rank{rank}"
        self._segment = 0
        self._pending: list[str] = []
        self._fd: int | None = None
        if isinstance(self._fs, LocalFileSystem):
            self._fd = os.open(self._stem + ".jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, text: str) -> None:
        """Hand whole lines to the OS now (local) or keep them for the next `sync` (object stores)."""
        if self._fd is None:
            self._pending.append(text)
            return
        data = text.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file takes it in one call; loop for the rare short write
            written += os.write(self._fd, data[written:])

    def sync(self) -> None:
        """Make every appended line durable (fsync, or one segment PUT)."""
        if self._fd is not None:
            os.fsync(self._fd)
        elif self._pending:
            self._fs.pipe_file(f"{self._stem}.{self._segment:06d}.jsonl", "".join(self._pending).encode())
            self._pending.clear()
            self._segment += 1

    def close(self) -> None:
        """Release the local file descriptor (segments need nothing)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class Ledger:
    """One attempt's records as read back; `torn` says a partial last line (a crash mid-write) was dropped."""

    source: str
    attempt: str
    rank: int
    records: tuple[dict[str, Any], ...]
    torn: bool


def parse_lines(text: str, source: str) -> tuple[list[dict[str, Any]], bool]:
    """Parse JSON lines; a bad last line is a torn write and is dropped, a bad line elsewhere is an error."""
    lines = text.split("\n")
    complete = text.endswith("\n") or not text
    if complete:
        lines = lines[:-1]
    records: list[dict[str, Any]] = []
    torn = False
    for i, line in enumerate(lines, start=1):
        last = i == len(lines)
        try:
            rec = json.loads(line)
            _check(rec, source, i)
        except (json.JSONDecodeError, LedgerError) as err:
            if last and (not complete or isinstance(err, json.JSONDecodeError)):
                torn = True
                break
            raise err if isinstance(err, LedgerError) else LedgerError(f"{source}:{i}: {err}") from None
        records.append(rec)
    return records, torn


def _check(rec: Any, source: str, line: int) -> None:
    """Reject records whose shape the attribution cannot trust."""
    if not isinstance(rec, dict) or "k" not in rec:
        raise LedgerError(f"{source}:{line}: expected an object with a 'k' field, got {str(rec)[:80]!r}")
    missing = [f for f in REQUIRED.get(rec["k"], ()) if f not in rec]
    if missing:
        raise LedgerError(f"{source}:{line}: {rec['k']!r} record lacks {missing}")
    for name in REQUIRED.get(rec["k"], ()):
        value, kind = rec[name], FIELD_TYPES.get(name)
        if kind and not _has_type(value, kind) and not (rec["k"] == "restore" and name == "s" and value is None):
            raise LedgerError(f"{source}:{line}: field {name!r} of a {rec['k']!r} record must be {kind}, got {value!r}")
    if rec.get("tier") is not None and not _has_type(rec["tier"], _STR):
        raise LedgerError(f"{source}:{line}: field 'tier' of a {rec['k']!r} record must be {_STR}, got {rec['tier']!r}")
    if rec["k"] == "alive" and not (isinstance(rec["open"], list) and all(_open_entry(x) for x in rec["open"])):
        raise LedgerError(
            f"{source}:{line}: field 'open' must be a list of [kind, name, begin, order], got {rec['open']!r}"
        )
    if _has_type(rec.get("b"), _INT) and _has_type(rec.get("e"), _INT) and rec["e"] < rec["b"]:
        raise LedgerError(f"{source}:{line}: interval ends before it begins ({rec['b']} > {rec['e']})")


def _open_entry(x: Any) -> bool:
    """[kind, name, begin, order] of an interval still open: a step's name is its number, a span's its category."""
    return (
        isinstance(x, list)
        and len(x) == 4
        and _has_type(x[2], _INT)
        and _has_type(x[3], _INT)
        and ((x[0] == "step" and _has_type(x[1], _INT)) or (x[0] == "span" and _has_type(x[1], _STR)))
    )


def read_ledgers(root: str, storage_options: dict[str, Any] | None = None) -> list[Ledger]:
    """Read every attempt's ledger under ROOT/ettr/, segments joined in order."""
    fs, base = fsspec.core.url_to_fs(ledger_dir(root), **(storage_options or {}))
    if not fs.exists(base):
        return []
    groups: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for path in fs.ls(base, detail=False):
        m = _NAME.match(path.rsplit("/", 1)[-1])
        if m:
            seg = int(m["seg"]) if m["seg"] else -1
            groups.setdefault((m["attempt"], int(m["rank"])), []).append((seg, path))
    ledgers = []
    for (attempt, rank), parts in sorted(groups.items()):
        records: list[dict[str, Any]] = []
        torn = False
        for _, path in sorted(parts):
            part, part_torn = parse_lines(fs.cat_file(path).decode("utf-8", errors="replace"), path)
            records.extend(part)
            torn = torn or part_torn
        if not records or records[0]["k"] != "start":
            raise LedgerError(f"{parts[0][1]}:1: a ledger must begin with a 'start' record")
        ledgers.append(Ledger(parts[0][1], attempt, rank, tuple(records), torn))
    return ledgers
