"""Append-only JSON-lines ledger per process attempt under ROOT/ettr/, readable after a SIGKILL."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import stat
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

LEDGER_DIR = "ettr"
# 2: a checkpoint_save span may carry a `part` attribute (SAVE_PARTS); 1 had none (overlap waits looked like saves)
FORMAT_VERSION = 2
_RANK_DIR = re.compile(r"rank\d+")  # an object store's per-rank prefix
_NAME = re.compile(r"^ledger-(?P<attempt>.+)-rank(?P<rank>\d+)(?:\.(?P<seg>\d{6}))?\.jsonl\Z")
# Fields every record of a kind must carry; unknown kinds are skipped so newer writers stay readable.
REQUIRED: dict[str, tuple[str, ...]] = {
    "start": ("t", "job", "attempt", "rank"),
    "step": ("s", "b", "e", "o"),
    "span": ("c", "b", "e", "o"),
    "alive": ("t", "open"),
    "commit": ("s", "t", "bg"),
    "restore": ("s", "t"),
    "ckpt_failed": ("s", "t", "err"),
    "delete": ("s", "t"),
    "end": ("t", "status"),
}


# The parts of a checkpoint save that are spans of their own (attribute `part` of a checkpoint_save span) -> the
# metric (duration histogram) each is recorded in. A checkpoint_save span without a part is one call of save();
# the part of its seconds outside its "previous_wait" spans is its stall.
SAVE_PARTS = {
    "previous_wait": "checkpoint_previous_wait",  # inside save(): waiting for the previous save to finish
    "overlap_wait": "checkpoint_overlap_wait",  # an optimizer step waiting for an overlapped snapshot's copies
}

# Where a commit or restore record's optional `tier` says the checkpoint went or came from (absent: one tier).
TIERS = ("local", "peer", "durable")
_INT, _NUM, _STR = "a 64-bit integer", "a finite number", "a string"
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
    "v": _INT,
}
# Optional fields attribution reads, per kind (checked when present; `tier` and a step's digest apart).
OPTIONAL: dict[str, tuple[str, ...]] = {"start": ("v",)}


def _has_type(value: Any, kind: str) -> bool:
    """Of `kind`, and numbers in a range the attribution's arithmetic holds (no NaN, inf or 10**400)."""
    if isinstance(value, bool):
        return False
    if kind == _INT:
        return isinstance(value, int) and -(2**63) < value < 2**63
    if kind == _NUM:
        return isinstance(value, (int, float)) and -1e15 <= value <= 1e15  # NaN compares false
    return isinstance(value, str)


class LedgerError(ValueError):
    """A ledger that cannot be read; the message names the file and line."""


def ledger_dir(root: str) -> str:
    """The folder holding the ledgers of a checkpoint root."""
    return root.rstrip("/") + "/" + LEDGER_DIR


def root_of(source: str) -> str:
    """The checkpoint root of a ledger's path or URL (a `Ledger.source`): `ledger_dir` undone."""
    return source.rsplit("/" + LEDGER_DIR + "/", 1)[0]


# Object-store defaults: one PUT a minute at most for step records, segments rolled at 1 MiB (docs/goodput.md
# counts the objects and requests these make).
UPLOAD_INTERVAL_S = 60.0
SEGMENT_BYTES = 1 << 20


def local_root(root: str) -> str | None:
    """The local directory of a root given as a path or ``file://`` URL; None for any other URL. ckpt's storage decides
    (one storage stack: a root is the same directory or URL for the ledger as for the checkpoints), and refuses what
    is neither: a URL missing its '//' (``s3:bucket/run``), a ``file://`` URL naming another host."""
    from ckpt.storage import local_dir  # the one exception to "no arrow between ckpt and ettr": IO mechanism

    return local_dir(root)


def open_url_store(root: str, storage_options: dict[str, Any] | None = None) -> Any:
    """ckpt's storage of an object-store (or ``memory://``) root: one storage stack, configured once per root
    (endpoint, credentials, timeouts from ``storage_options`` and the standard environment variables)."""
    from ckpt.storage import open_storage  # the one exception to "no arrow between ckpt and ettr": IO mechanism

    return open_storage(root, storage_options)


def _free_ids(attempt: str) -> Iterator[str]:
    """`attempt`, then ``<attempt>.2``, ``.3``...: a process given the id of an earlier attempt (a requeued job
    passing its scheduler's id) gets a ledger of its own instead of appending to that attempt's (one attempt
    with two starts would hide the failure and the downtime between them)."""
    return (attempt if n == 1 else f"{attempt}.{n}" for n in itertools.count(1))


def _create_local(folder: str, attempt: str, rank: int) -> tuple[str, int]:
    """Create the ledger file of the first free id of `attempt` (O_EXCL: two processes never share one)."""
    for candidate in _free_ids(attempt):
        try:
            path = os.path.join(folder, f"ledger-{candidate}-rank{rank}.jsonl")
            return candidate, os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
    raise AssertionError("unreachable: the ids never run out")


class LedgerWriter:
    """Appends whole lines: each `append` reaches the OS at once on local disks, `sync` makes them durable.

    Locally a line handed to the kernel with one write(2) survives a SIGKILL of the process (not a power loss,
    which `sync`'s fsync covers). Object stores cannot append: there lines wait in memory and `sync` PUTs the
    whole current segment ``rank<r>/ledger-<attempt>-rank<r>.NNNNNN.jsonl`` again (one atomic PUT, never torn), at most
    every `upload_interval` seconds unless forced; a segment that reached `segment_bytes` is sealed and the next
    one starts, so a rank's object count grows with its ledger's size, not with its flushes.

    `attempt` is the id the ledger was created under: the one asked for, or ``<id>.2``... if a ledger of that id
    and rank exists already (`_free_ids`).
    """

    def __init__(
        self,
        root: str,
        attempt: str,
        rank: int,
        storage_options: dict[str, Any] | None = None,
        *,
        upload_interval: float = UPLOAD_INTERVAL_S,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self._closed = False
        self._fd: int | None = None
        self._pid = os.getpid()  # the process the ledger belongs to
        self._forked = False  # this is a forked child's copy of it (`forked`)
        local = local_root(root)
        if local is not None:
            os.makedirs(os.path.join(local, LEDGER_DIR), exist_ok=True)
            self.attempt, self._fd = _create_local(os.path.join(local, LEDGER_DIR), attempt, rank)
            self._name = f"ledger-{self.attempt}-rank{rank}"
            return
        self._store = open_url_store(root, storage_options)
        taken = {m["attempt"] for m in map(_NAME.match, self._store.list_files(f"{LEDGER_DIR}/rank{rank}")) if m}
        self.attempt = next(a for a in _free_ids(attempt) if a not in taken)
        self._name = f"ledger-{self.attempt}-rank{rank}"
        self._stem = f"{LEDGER_DIR}/rank{rank}/{self._name}"
        self._upload_us = round(upload_interval * 1e6)
        self._segment_bytes = segment_bytes
        self._segment = 0
        self._lines: list[str] = []  # the current segment's text, PUT whole at every sync
        self._size = 0
        self._synced = 0  # how many of `_lines` the last PUT held
        self._last_put: int | None = None

    def append(self, text: str) -> None:
        """Hand whole lines to the OS now (local) or keep them for the next `sync` (object stores)."""
        self.check_open()
        if self._fd is None:
            self._lines.append(text)
            self._size += len(text)
            return
        data = text.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file takes it in one call; loop for the rare short write
            written += os.write(self._fd, data[written:])

    def due(self, now_us: int) -> bool:
        """Whether a periodic `sync` at `now_us` should run: always locally, once per `upload_interval` on objects."""
        return self._fd is not None or self._last_put is None or now_us - self._last_put >= self._upload_us

    def sync(self, now_us: int) -> None:
        """Make every appended line durable: fsync, or one PUT of the current segment (nothing new: no PUT)."""
        self.check_open()
        if self._fd is not None:
            os.fsync(self._fd)
            return
        if len(self._lines) == self._synced:
            return
        self._store.write_atomic(f"{self._stem}.{self._segment:06d}.jsonl", "".join(self._lines).encode())
        self._last_put = now_us
        self._synced = len(self._lines)
        if self._size >= self._segment_bytes:  # sealed: later lines go to the next segment
            self._segment += 1
            self._lines, self._size, self._synced = [], 0, 0

    def close(self) -> None:
        """Release the local file descriptor (segments need nothing); later records are an error."""
        if self._fd is not None and not self._closed:
            os.close(self._fd)
        self._closed = True

    def forked(self) -> None:
        """In a forked child (called after a fork): refuse every record from now on and close the child's copy of the
        descriptor. The ledger is the parent's: a child's records landed in it, between the parent's, with orders
        the parent had given already and an end record in the middle that no reader refused; on an object store its
        PUT would have replaced the parent's segment with the child's stale copy."""
        if self._fd is not None and not self._closed:
            os.close(self._fd)
        self._closed = self._forked = True

    def check_open(self) -> None:
        """Raise the refusal of a closed ledger (ValueError naming it), or of one a forked child inherited
        (RuntimeError naming it and both processes); nothing when it is open."""
        if self._forked:
            raise RuntimeError(
                f"{self._name}: the ledger of process {self._pid}, and this process ({os.getpid()}) is a fork of it: "
                "two processes never share a ledger, so a forked child records nothing with its parent's tracker; "
                "make a GoodputTracker of its own in the child if it is to be measured"
            )
        if self._closed:
            raise ValueError(f"{self._name}: the ledger is closed (the tracker's end() was called); record refused")


@dataclass(frozen=True)
class Ledger:
    """One attempt's records as read back; `torn` says a partial last line (a crash mid-write) was dropped."""

    source: str
    attempt: str
    rank: int
    records: tuple[dict[str, Any], ...]
    torn: bool

    @property
    def began_us(self) -> int:
        """When its tracker began recording: its earliest record after the start record (the start's `t` is the
        process's start, read in clock ticks of 10 ms: two trackers of one process get starts in either order)."""
        start = self.records[0]["t"]
        return min((r["t"] if "t" in r else r.get("b", start) for r in self.records[1:]), default=start)


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
        except (ValueError, RecursionError) as err:  # not JSON (too deep, an int past 4,300 digits), or our check
            if last and (not complete or not isinstance(err, LedgerError)):
                torn = True
                break
            if isinstance(err, LedgerError):
                raise
            raise LedgerError(f"{source}:{i}: not a JSON record ({type(err).__name__}: {str(err)[:100]})") from None
        records.append(rec)
    return records, torn


def _check(rec: Any, source: str, line: int) -> None:
    """Reject records whose shape the attribution cannot trust."""
    if not isinstance(rec, dict) or not isinstance(rec.get("k"), str):
        raise LedgerError(f"{source}:{line}: expected an object with a string 'k' field, got {str(rec)[:80]!r}")
    missing = [f for f in REQUIRED.get(rec["k"], ()) if f not in rec]
    if missing:
        raise LedgerError(f"{source}:{line}: {rec['k']!r} record lacks {missing}")
    for name in (*REQUIRED.get(rec["k"], ()), *(f for f in OPTIONAL.get(rec["k"], ()) if f in rec)):
        value, kind = rec[name], FIELD_TYPES.get(name)
        if kind and not _has_type(value, kind) and not (rec["k"] == "restore" and name == "s" and value is None):
            raise LedgerError(f"{source}:{line}: field {name!r} of a {rec['k']!r} record must be {kind}, got {value!r}")
    if rec.get("tier") is not None and not _has_type(rec["tier"], _STR):
        raise LedgerError(f"{source}:{line}: field 'tier' of a {rec['k']!r} record must be {_STR}, got {rec['tier']!r}")
    if rec["k"] == "step" and len(rec) > 5:
        _check_digest(rec, source, line)
    if rec["k"] == "span" and "a" in rec:
        _check_attrs(rec, source, line)
    if rec["k"] == "alive" and not (isinstance(rec["open"], list) and all(_open_entry(x) for x in rec["open"])):
        raise LedgerError(
            f"{source}:{line}: field 'open' must be a list of [kind, name, begin, order], got {rec['open']!r}"
        )
    if _has_type(rec.get("b"), _INT) and _has_type(rec.get("e"), _INT) and rec["e"] < rec["b"]:
        raise LedgerError(f"{source}:{line}: interval ends before it begins ({rec['b']} > {rec['e']})")


_BITS = re.compile(r"^[0-9a-f]{16}\Z")


def _check_digest(rec: dict[str, Any], source: str, line: int) -> None:
    """A step record's optional digest (ettr.replay): `l` 16 hex digits, `h` a string, `x` {name: 16 hex digits}."""
    loss, batch, scalars = rec.get("l"), rec.get("h"), rec.get("x")
    if loss is not None and not (isinstance(loss, str) and _BITS.match(loss)):
        raise LedgerError(f"{source}:{line}: field 'l' of a 'step' record must be 16 hex digits, got {loss!r}")
    if batch is not None and not isinstance(batch, str):
        raise LedgerError(f"{source}:{line}: field 'h' of a 'step' record must be {_STR}, got {batch!r}")
    if scalars is not None and not (
        isinstance(scalars, dict) and all(isinstance(v, str) and _BITS.match(v) for v in scalars.values())
    ):
        raise LedgerError(
            f"{source}:{line}: field 'x' of a 'step' record must map names to 16 hex digits, got {scalars!r}"
        )


def _check_attrs(rec: dict[str, Any], source: str, line: int) -> None:
    """A span's attributes `a`: an object; a checkpoint_save's `part` a string and `step` an integer (or null), as
    attribution tells a save's parts and steps apart by them."""
    attrs = rec["a"]
    if not isinstance(attrs, dict):
        raise LedgerError(f"{source}:{line}: field 'a' of a 'span' record must be an object, got {str(attrs)[:80]!r}")
    if rec["c"] != "checkpoint_save":
        return
    for name, kind in (("part", _STR), ("step", _INT)):
        value = attrs.get(name)
        if value is not None and not _has_type(value, kind):
            raise LedgerError(
                f"{source}:{line}: field 'a.{name}' of a 'checkpoint_save' span must be {kind}, got {str(value)[:80]!r}"
            )


def _open_entry(x: Any) -> bool:
    """[kind, name, begin, order] of an interval still open: a step's name is its number, a span's its category."""
    return (
        isinstance(x, list)
        and len(x) == 4
        and _has_type(x[2], _INT)
        and _has_type(x[3], _INT)
        and ((x[0] == "step" and _has_type(x[1], _INT)) or (x[0] == "span" and _has_type(x[1], _STR)))
    )


class _Files:
    """The ledger files of a root: a local folder (flat), or an object store's keys under ettr/rank<r>/ (one LIST
    prefix per rank, so a rank's reader never pages through the other ranks' segments)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None) -> None:
        local = local_root(root)
        self._base = os.path.abspath(os.path.join(local, LEDGER_DIR)) if local is not None else None
        self._url = ledger_dir(root)
        with self._unreachable():
            self._store = open_url_store(root, storage_options) if local is None else None

    @contextlib.contextmanager
    def _unreachable(self) -> Iterator[None]:
        """A store that cannot be read (unreachable, refused, timed out) is a LedgerError naming it."""
        if self._base is not None:
            yield
            return
        from ckpt.storage import StorageError

        try:
            yield
        except StorageError as err:
            raise LedgerError(f"cannot read the ledgers in {self._url}: {err}") from err

    def names(self, rank: int | None = None) -> list[str]:
        """Paths relative to ettr/ of the ledgers (of `rank` only when given)."""
        if self._store is None:
            return _local_names(self._base, rank)
        with self._unreachable():
            names = self._store.list_files(LEDGER_DIR if rank is None else f"{LEDGER_DIR}/rank{rank}")
        return [n if rank is None else f"rank{rank}/{n}" for n in names]

    def read(self, name: str) -> bytes:
        if self._store is None:
            return _read_regular(os.path.join(self._base, name))
        with self._unreachable():
            data = self._store.read(f"{LEDGER_DIR}/{name}")
        if data is None:
            raise LedgerError(f"{self.where(name)}: listed but gone when read (deleted meanwhile?)")
        return data

    def where(self, name: str) -> str:
        """The path or URL a user finds the file at."""
        return os.path.join(self._base, name) if self._store is None else f"{self._url}/{name}"


def _read_regular(path: str) -> bytes:
    """A local ledger's bytes; a FIFO, a device there (``/dev/zero``) or a directory is a LedgerError naming `path`,
    never read (checked before the descriptor becomes a file object, which refuses a directory naming the fd)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LedgerError(f"{path}: not a regular file (mode {stat.filemode(mode)})")
    with open(fd, "rb") as f:
        return f.read()


def _local_names(base: str, rank: int | None) -> list[str]:
    """A local folder's ledger names: flat as written here, and under ``rank<r>/`` as in a copy of an object-store
    root (``aws s3 sync``), only rank `rank`'s folder when given."""
    if not os.path.isdir(base):
        return []
    names = []
    for entry in sorted(os.listdir(base)):
        folder = os.path.join(base, entry)
        if _RANK_DIR.fullmatch(entry) and os.path.isdir(folder):
            if rank is None or entry == f"rank{rank}":
                names += [f"{entry}/{n}" for n in sorted(os.listdir(folder))]
        else:
            names.append(entry)
    return names


def _grouped(names: list[str], rank: int | None = None) -> dict[tuple[str, int], list[tuple[int, str]]]:
    """(attempt, rank) -> [(segment, name)] of the names that are ledgers (of `rank` only when given)."""
    groups: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for name in names:
        m = _NAME.match(name.rsplit("/", 1)[-1])
        if m and (rank is None or int(m["rank"]) == rank):
            groups.setdefault((m["attempt"], int(m["rank"])), []).append((int(m["seg"]) if m["seg"] else -1, name))
    return groups


def ledger_ranks(root: str, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The ranks that have a ledger under ROOT/ettr/ (a LIST, no GET)."""
    return sorted({r for _, r in _grouped(_Files(root, storage_options).names())})


def no_ledgers(root: str) -> LedgerError:
    """The error for a root with no ledger to read: it does not exist, is not a directory, holds none, or is the
    ledgers' own folder (ROOT/ettr given as the root)."""
    local = local_root(root)
    if local is not None and not os.path.isdir(local):
        what = "not a directory" if os.path.exists(local) else "no such directory"
        return LedgerError(f"{root}: {what} (give the checkpoint root the job's GoodputTracker wrote to)")
    if local is not None and any(_NAME.match(name) for name in os.listdir(local)):
        return LedgerError(
            f"no ledgers in {ledger_dir(root)}: {root} holds ledgers itself: give the checkpoint root, the folder "
            "above it"
        )
    return LedgerError(f"no ledgers in {ledger_dir(root)}: a job's GoodputTracker on this root writes them there")


def _check_attempt(located: list[tuple[str, int, dict[str, Any]]], rank: int) -> None:
    """Records that contradict their ledger are an error naming file and line: a start record of another rank than
    the file name's (its records would count as that rank's), a record dated before the attempt's start (one clock
    runs through a ledger from its start: an earlier one would be cut off, the wall time left at 0)."""
    source, _, start = located[0]
    if start["rank"] != rank:
        raise LedgerError(f"{source}:1: the start record's rank {start['rank']} is not the file name's (rank{rank})")
    for source, line, rec in located[1:]:
        t = rec.get("b", rec.get("t")) if rec["k"] in REQUIRED else None  # a kind we do not know: its fields either
        if t is not None and t < start["t"]:
            raise LedgerError(
                f"{source}:{line}: a {rec['k']!r} record at t={t}, before its attempt's start (t={start['t']})"
            )


def read_ledgers(
    root: str,
    storage_options: dict[str, Any] | None = None,
    *,
    rank: int | None = None,
    known: Mapping[tuple[str, int], Ledger] | None = None,
) -> list[Ledger]:
    """Read every attempt's ledger under ROOT/ettr/ (only rank `rank`'s when given), segments joined in order.

    An object-store root costs one LIST (a page per 1,000 objects; with `rank`, of that rank's objects only) and
    one GET per segment. `known`: ledgers read before, by (attempt, rank), taken as they are while their attempt's
    files are listed, not read again (those of attempts that ended: they write no more).
    """
    files = _Files(root, storage_options)
    ledgers = []
    for key, parts in sorted(_grouped(files.names(rank), rank).items()):
        ledger = known[key] if known and key in known else _read_attempt(files, *key, sorted(parts))
        if ledger is not None:
            ledgers.append(ledger)
    return ledgers


def _read_attempt(files: _Files, attempt: str, rank: int, parts: list[tuple[int, str]]) -> Ledger | None:
    """One attempt's ledger from its files (segment, name) in order; None (with a warning) when they hold no record."""
    segments = [seg for seg, _ in parts]
    if len(parts) > 1 and (-1 in segments or len(set(segments)) < len(segments)):  # its records would count twice
        raise LedgerError(
            f"the ledger of attempt {attempt}, rank {rank} is there twice (a copy of an object-store root's ettr/rank"
            f"{rank}/ beside a local ledger of that attempt?): {', '.join(files.where(n) for _, n in parts)}; keep one"
        )
    located: list[tuple[str, int, dict[str, Any]]] = []  # (file, line, record)
    torn = False
    for _, name in parts:
        where = files.where(name)
        part, part_torn = parse_lines(files.read(name).decode("utf-8", errors="replace"), where)
        located += [(where, line, rec) for line, rec in enumerate(part, start=1)]
        torn = torn or part_torn
    records = [rec for *_, rec in located]
    if not records:  # an attempt that died (or found the disk full) before its start record was written
        warnings.warn(
            f"{files.where(parts[0][1])}: an empty ledger (its attempt ended before writing its start record): "
            "left out of the report",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    if records[0]["k"] != "start":
        raise LedgerError(f"{files.where(parts[0][1])}:1: a ledger must begin with a 'start' record")
    _check_attempt(located, rank)
    return Ledger(files.where(parts[0][1]), attempt, rank, tuple(records), torn)
