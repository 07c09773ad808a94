"""GoodputTracker: records steps and spans of one process attempt into its ledger, with live per-category totals."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import operator
import os
import reprlib
import socket
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from typing import Any, NamedTuple

from .attribution import SAVE_SPLIT, Attribution, attribute
from .clock import Clock, SystemClock
from .formulas import check_seconds, check_window
from .ledger import (
    FORMAT_VERSION,
    SAVE_PARTS,
    TIERS,
    UPLOAD_INTERVAL_S,
    LedgerError,
    LedgerWriter,
    local_root,
    read_ledgers,
)
from .replay import Replay, compare, float_bits
from .stragglers import WAIT, WINDOW_STEPS, WindowMeter
from .telemetry import GoodputMetrics

FLUSHED_SPANS = frozenset({"checkpoint_save", "checkpoint_restore"})
log = logging.getLogger("ettr")


def _env_rank() -> int:
    """This process's rank from the usual launcher variables, 0 alone: ettr imports neither torch nor ckpt, and the
    variables exist before any process group (integrations may pass ``rank=`` instead). One that is no non-negative
    integer is a ValueError naming it: RANK=-1 made a ledger ``...-rank-1.jsonl`` that no report reads."""
    for var in ("RANK", "SLURM_PROCID"):
        text = os.environ.get(var)
        if text is None:
            continue
        try:
            rank = int(text)
        except ValueError:
            rank = -1
        if rank < 0:
            raise ValueError(
                f"{var}={text!r} in the environment is no rank (a non-negative integer): fix it or pass rank="
            )
        return rank
    return 0


# Where a job id comes from when no job_id= is given: ETTR_JOB_ID, else the launcher's run id in the order ckpt reads
# it (ckpt.run.ENV_IDS; torchrun's TORCHELASTIC_RUN_ID default "none" is no id).
JOB_ENV = ("ETTR_JOB_ID", "CKPT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def _env_job() -> str | None:
    """A job id from ETTR_JOB_ID or the launcher's run id; None when the environment names none."""
    for var in JOB_ENV:
        value = os.environ.get(var, "")
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            return value
    return None


def _new_attempt_id(wall_us: int) -> str:
    """A unique attempt id that sorts by start time."""
    return (
        time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall_us / 1e6)) + f"{wall_us % 1_000_000:06d}-{uuid.uuid4().hex[:6]}"
    )


def _integer(name: str, value: Any) -> int:
    """`value` as an int: an int, a numpy integer or a 0-d integer tensor (``operator.index``); a bool, a float or
    anything else is a TypeError naming `name`. Steps and byte counts reach the ledger as JSON integers: one that did
    not would make the whole job's ledger unreadable, or fail a later record far from the call that passed it."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not -_INT64 < value < _INT64:  # as the ledger's reader takes them (`ledger.FIELD_TYPES`)
        raise ValueError(f"{name} must be a 64-bit integer (below 2**63 in size), got {_shown(value)}")
    return value


_INT64 = 1 << 63


def _shown(value: Any) -> str:
    """`value` for a message, cut short; one holding an int too long for `repr` (4,300 digits) by its type."""
    try:
        return reprlib.repr(value)
    except ValueError:
        return f"({type(value).__name__} holding an int of over 4,300 digits)"


def _number(value: Any) -> Any:
    """`json.dumps`'s fallback: a 0-d tensor or numpy scalar is its Python number, as in ckpt's save metadata."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__qualname__} is not JSON")


_PLAIN = (str, int, bool, type(None))  # attribute values written as they are, no JSON round trip


def _json_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """A span's attributes as the ledger will hold them, checked at the call: finite numbers, str, bool, None, lists
    and dicts of them, 0-d tensors and numpy scalars as numbers (a copy: later changes to a list do not reach the
    record). Anything else is an error naming the attribute now, not a lost record and a failing later flush."""
    out: dict[str, Any] = {}
    for name, value in attrs.items():
        if (type(value) in _PLAIN and (type(value) is not int or -_INT64 < value < _INT64)) or (
            type(value) is float and math.isfinite(value)
        ):
            out[name] = value
            continue
        try:
            out[name] = json.loads(json.dumps(value, allow_nan=False, default=_number))
        except (TypeError, ValueError) as e:  # ValueError: NaN or infinity, or a circular reference
            raise (ValueError if isinstance(e, ValueError) else TypeError)(
                f"span attribute {name}= must be JSON (finite numbers, str, bool, None, lists, dicts; 0-d tensors "
                f"and numpy scalars become numbers), got {type(value).__name__} {_shown(value)}: {e}"
            ) from None
    return out


def _tier(tier: str | None) -> dict[str, str]:
    """The optional `tier` field of a commit or restore record; a ValueError for an unknown tier."""
    if tier is None:
        return {}
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)} or None, got {tier!r}")
    return {"tier": tier}


_STEP = '{"k":"step","s":%d,"b":%d,"e":%d,"o":%d}\n'
_STEP_DIGEST = '{"k":"step","s":%d,"b":%d,"e":%d,"o":%d%s}\n'  # the last: the digest's fields (`_digest`)


def _digest(loss: Any, batch: str | None, scalars: dict[str, Any] | None) -> tuple[tuple, str]:
    """A step's digest, (loss bits, batch, scalars' bits) as a plain tuple (`Digest`'s fields: one the garbage
    collector stops tracking), and its record's fields ``,"l":...,"h":...,"x":{...}`` (ettr.replay)."""
    try:
        bits = None if loss is None else float_bits(loss)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        raise TypeError(f"loss must be a number or a one-element tensor, got {loss!r}") from None
    text = "" if bits is None else ',"l":"' + bits + '"'
    if batch is not None:
        if type(batch) is not str:
            raise TypeError(f"batch must be the batch hash as a string (e.g. sampler.batch_hash(step)), got {batch!r}")
        text += ',"h":"' + batch + '"' if batch.isalnum() else ',"h":' + json.dumps(batch)
    try:
        named = tuple(sorted((str(k), float_bits(v)) for k, v in scalars.items())) if scalars else ()
    except (AttributeError, TypeError, ValueError, RuntimeError):  # not a dict, or a value that is no number
        raise TypeError(f"scalars must be a dict of numbers, got {str(scalars)[:200]}") from None
    if named:
        text += ',"x":' + json.dumps(dict(named), separators=(",", ":"))
    return (bits, batch, named), text


@functools.lru_cache(maxsize=256)
def _quoted(name: str) -> str:
    """A span category as a JSON string (cached: the step path encodes the same few names over and over)."""
    return json.dumps(name)


def _encode(rec: tuple | dict[str, Any]) -> str:
    """One ledger line from a buffered record: (step, b, e, order[, digest fields]), (category, b, e, order, attrs)
    or a dict."""
    if type(rec) is tuple and len(rec) == 4:
        return _STEP % rec
    if type(rec) is tuple and type(rec[0]) is int:
        return _STEP_DIGEST % rec
    if type(rec) is tuple:
        category, begin, end, order, attrs = rec
        if not attrs:
            return '{"k":"span","c":%s,"b":%d,"e":%d,"o":%d}\n' % (_quoted(category), begin, end, order)
        rec = {"k": "span", "c": category, "b": begin, "e": end, "o": order, "a": attrs}
    return json.dumps(rec, separators=(",", ":")) + "\n"


# The sliding window's history keeps snapshots at least 1/WINDOW_PARTS of the window apart (of two neighbours the
# later one moves on instead of a new one being added): at most 2 * WINDOW_PARTS + 3 of them whatever the flush rate
# (one per flush grew to 12.5 MB per 100k steps at flush_interval=0), and the windowed ratio within 1/WINDOW_PARTS of
# the one taken at every flush
WINDOW_PARTS = 1000

_EVERY_STEP = _INT64  # `_through` while the earlier attempts are read: every step ended is kept for the comparison


class _Prior(NamedTuple):
    """What an attempt takes from the earlier attempts' ledgers (`_earlier_attempts`)."""

    # (step, time) of the job's newest commit, for the checkpoint gauges; the time on this attempt's clock (the
    # timeline's less `shift_us`), which its own commits and the age's "now" are read on
    newest_commit: tuple[int, int] | None
    attribution: Attribution | None  # the whole job's, this attempt last; None without an earlier attempt
    earlier: dict[str, int]  # microseconds per category of the earlier attempts
    earlier_split: dict[str, int]  # and their checkpoint time by part
    failures: int | None  # the earlier attempts that failed
    expect: dict[int, tuple[str, tuple | None]]  # step -> its first pass, for the steps this attempt has yet to redo
    # this attempt's first microseconds, from its process's start, that the job's timeline gives to the attempt before
    # it (a second tracker of one process: its startup is dated from the process start, which the first one covers)
    overlap_us: int = 0
    # how far the job's timeline moved this attempt from its own clock (a wall clock that went back between attempts:
    # attribution places it after the attempt before); its time t is t + shift_us there
    shift_us: int = 0


def _earlier_attempts(root: str, storage_options: dict[str, Any] | None, rank: int) -> _Prior:
    """Read and attribute the job's ledgers of `rank`, this attempt's (the last) included: the figures of the attempts
    before it. Touches no tracker: a tracker calls it without its lock, while its own ledger grows (the figures of
    the earlier attempts depend on this attempt's start and resume only, which are on disk by then)."""
    try:
        ledgers = read_ledgers(root, storage_options, rank=rank)
    except (LedgerError, OSError) as e:  # the goodput of earlier attempts is lost to telemetry, not the training
        log.warning("goodput: the earlier attempts' ledgers cannot be read (%s): telemetry counts this one only", e)
        ledgers = []
    if len(ledgers) <= 1:  # this attempt's own commits, if any: on its own clock
        commits = [(r["s"], r["t"]) for l in ledgers for r in l.records if r["k"] == "commit"]
        return _Prior(max(commits) if commits else None, None, {}, {}, 0, {})
    prior = attribute(ledgers, rank=rank)
    me = prior.attempts[-1]
    earlier = {cat: us - me.micros.get(cat, 0) for cat, us in prior.micros.items()}
    # the tracker counts its own time from its process's start; attribution may start it later (at the end of the
    # attempt before, which ran in the same process) and may move it whole (a wall clock that went back): what it
    # cut is the tracker's startup the job's totals must not count twice
    mine = next(l for l in ledgers if l.attempt == me.attempt)
    shift = me.end_us - max(r.get("e", r.get("t", me.start_us)) for r in mine.records)
    overlap = max(0, me.start_us - shift - mine.records[0]["t"])
    earlier["startup"] = earlier.get("startup", 0) - overlap
    split = {**prior.checkpoint_split_us, "background_write": prior.background_us}
    mine_split = {**me.checkpoint_split_us, "background_write": me.background_us}
    earlier_split = {part: us - mine_split.get(part, 0) for part, us in split.items()}
    failures = sum(a.failed for a in prior.attempts[:-1])
    # the steps of this attempt already recorded are compared; plain tuples, which the collector lets be
    expect = {s: (a, None if d is None else tuple(d)) for s, (a, d) in me.replay.pending.items()}
    # the newest commit as attribution places it, brought onto this attempt's clock: an earlier attempt's raw ledger
    # time is on its own clock, and one that ran ahead of this one (a wall clock that went back) made the age negative
    newest = None if prior.newest_commit is None else (prior.newest_commit[0], prior.newest_commit[1] - shift)
    return _Prior(newest, prior, earlier, earlier_split, failures, expect, overlap, shift)


def _not_started() -> int:
    raise RuntimeError(
        "GoodputTracker records nothing before start(): call tracker.start(), or use it as a context manager "
        "(with GoodputTracker(root) as tracker: ...)"
    )


def _check_args(root: Any, job_id: Any, attempt_id: Any, rank: Any, storage_options: Any) -> str:
    """GoodputTracker's root as a str (a path, os.PathLike, or URL); a TypeError or ValueError naming an argument of
    the wrong type or value, at construction rather than from fsspec at start() or from a ledger no report can read."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if not isinstance(root, str):
        raise TypeError(f"root must be a path or URL (str or os.PathLike), got {type(root).__name__} {root!r}")
    if not root:
        raise ValueError("root must be a path or URL, got ''")
    local_root(root)  # a URL missing its '//' (s3:bucket/run), a file:// URL of another host: refused now
    for name, value in (("job_id", job_id), ("attempt_id", attempt_id)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, got {type(value).__name__} {value!r}")
    if attempt_id and ("/" in attempt_id or any(c < " " or c == "\x7f" for c in attempt_id)):
        # a newline made a ledger no report lists (its name matched no ledger's), a NUL failed start() in os.open
        raise ValueError(
            f"attempt_id names a ledger file and cannot hold '/' or control characters (newline, NUL), got {attempt_id!r}"
        )
    if rank is not None and _integer("rank", rank) < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    return root


_HOLDING: weakref.WeakSet[GoodputTracker] = weakref.WeakSet()  # trackers with an open ledger, for `_forked`


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing.Process) holds copies of its parent's trackers: each
    is told it is a copy (`GoodputTracker._in_forked_child`)."""
    for tracker in list(_HOLDING):
        tracker._in_forked_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Span:
    """Context manager for one span; a class rather than a generator to keep the step path lean."""

    __slots__ = ("_tracker", "_category", "_attrs", "_entry")

    def __init__(self, tracker: GoodputTracker, category: str, attrs: dict[str, Any]) -> None:
        self._tracker, self._category, self._attrs = tracker, category, attrs

    def __enter__(self) -> _Span:
        self._entry = self._tracker._open(self._category, None, self._attrs)
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracker._close(self._entry)


class _Step:
    """Context manager form of step_begin/step_end; `record` attaches the step's digest to its end."""

    __slots__ = ("_tracker", "_step", "_loss", "_batch", "_scalars")

    def __init__(self, tracker: GoodputTracker, step: int) -> None:
        self._tracker, self._step = tracker, step
        self._loss = self._batch = self._scalars = None

    def __enter__(self) -> _Step:
        self._tracker.step_begin(self._step)
        return self

    def record(self, loss: Any = None, *, batch: str | None = None, scalars: dict[str, Any] | None = None) -> None:
        """The step's loss, batch hash and scalars, written with its record when it ends (see `step_end`)."""
        self._loss, self._batch, self._scalars = loss, batch, scalars

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self._tracker.step_end(self._step, self._loss, batch=self._batch, scalars=self._scalars)
        else:  # the body's error is the one to see: the step ends without its digest, which could only mask it
            self._tracker.step_end(self._step)


class GoodputTracker:
    """Measures one process attempt of a training job and appends it to ROOT/ettr/ledger-<attempt>-rank<r>.jsonl.

    The step path reads the clock and hands the step's ledger line to the OS with one write(2), so the steps before
    a SIGKILL count as lost work, not downtime; every `flush_interval` seconds, at every checkpoint save/restore
    and at end() a heartbeat is added and the ledger fsynced. Object stores cannot
    append: there records wait in memory and the periodic flush PUTs them once per `upload_interval` (60 s), the
    checkpoint events and end() at once (docs/goodput.md: objects and requests). Also the duck-typed tracker
    that ckpt.CheckpointManager reports to (span, checkpoint_committed/restored/failed); every method is
    thread-safe, since those may come from the manager's writer thread.

    `attempt_id` defaults to a new id per process; an id whose ledger exists already (a requeued job passing its
    scheduler's id again) is recorded as ``<id>.2``, ``<id>.3``... with a warning, so each process is its own attempt.
    """

    def __init__(
        self,
        root: str,
        *,
        job_id: str | None = None,
        attempt_id: str | None = None,
        rank: int | None = None,
        clock: Clock | None = None,
        flush_interval: float = 1.0,
        window_s: float = 3600.0,
        metrics: GoodputMetrics | None = None,
        storage_options: dict[str, Any] | None = None,
        upload_interval: float = UPLOAD_INTERVAL_S,
        straggler_window: int = WINDOW_STEPS,
    ) -> None:
        root = _check_args(root, job_id, attempt_id, rank, storage_options)
        check_seconds("flush_interval", flush_interval)
        check_window("window_s", window_s)
        check_seconds("upload_interval", upload_interval)
        self.root = root
        self.clock = clock or SystemClock()
        self.rank = _env_rank() if rank is None else _integer("rank", rank)
        # the job: job_id=, else the environment's; else the run id a CheckpointManager tells (use_run_id), and
        # until it does (or without one) the root
        self.job_id = job_id or _env_job() or root
        self._job_known = bool(job_id or _env_job())
        self.attempt_id = attempt_id or _new_attempt_id(self.clock.wall_us() - self.clock.process_age_us())
        self.window_s = window_s
        self.metrics = metrics if metrics is not None else GoodputMetrics()
        self._flush_us = round(flush_interval * 1e6)
        self.storage_options = storage_options  # the ledgers' store's (an object-store root's)
        self._upload_interval = upload_interval
        self._buf: deque[Any] = deque()
        self._stack: list[list[Any]] = []  # open intervals, oldest first: [order, category, step, begin, attrs]
        self._acc: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.RLock()
        self._writer: LedgerWriter | None = None  # created by start(), or before it by claim_attempt()
        self._started = False
        self._mono = _not_started  # the attempt's clock, from start(): nothing is recorded before it
        self._ended: int | None = None  # the end's last record (its heartbeat), once end() closed the ledger
        self._prior: Attribution | None = None
        self._earlier: dict[str, int] = {}  # microseconds per category of the earlier attempts
        self._overlap = 0  # microseconds of this attempt's startup the timeline gives to the one before (_Prior)
        self._shift = 0  # microseconds the job's timeline moved this attempt by (_Prior.shift_us)
        # checkpoint time by part (SAVE_SPLIT, and "background_write"): this attempt's from its closed spans and
        # commits, the earlier attempts' from their ledgers
        self._split: dict[str, int] = dict.fromkeys((*SAVE_SPLIT, "background_write"), 0)
        self._earlier_split: dict[str, int] = {}
        self._prior_done = False
        self._loading = False  # a thread reads the earlier attempts' ledgers (`_load_prior`), without the lock
        self._loaded = threading.Condition(self._lock)  # notified when it is done
        self._failures: int | None = None  # failed earlier attempts, once read: set at every export
        self._resume_known = False  # a restore, a first step or the end tells where this attempt resumed
        self._history: deque[tuple[int, int]] = deque()  # (time, own productive us) at exports, for the window
        self._history_gap = max(1, round(window_s * 1e6 / WINDOW_PARTS))  # microseconds between snapshots kept
        self._exported: dict[str, int] = {}  # this attempt's microseconds per category already counted
        # replay verification (ettr.replay): this attempt's steps compared so far; the first passes of the steps it
        # has yet to train again, the last of them, and the digests of those ended since the last comparison
        self._replay = Replay()
        self._expect: dict[int, tuple[str, tuple | None]] = {}  # step -> (attempt, digest fields)
        self._through: int | None = None
        self._replayed: list[tuple[int, tuple | None]] = []
        # busy and collective-wait time per window of steps, live
        self._windows = WindowMeter(_integer("straggler_window", straggler_window))

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> GoodputTracker:
        """Open the ledger; the attempt is dated from the process's start (imports count as startup)."""
        if self._started:
            raise RuntimeError("GoodputTracker.start() called twice")
        self._started = True
        wall = self.clock.wall_us() - self.clock.process_age_us()  # the attempt starts when the process did
        self._mono = self.clock.monotonic_us
        self._offset = self.clock.wall_us() - self._mono()
        self.claim_attempt()
        self._start = self._last = self._last_flush = wall
        self._order = 0
        self._gap = "startup"
        self.use_metrics(self.metrics)  # label them with this attempt now that its clock runs
        self._buf.append(
            {
                "k": "start",
                "t": wall,
                "job": self.job_id,
                "attempt": self.attempt_id,
                "rank": self.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "v": FORMAT_VERSION,
            }
        )
        self.flush()
        return self

    def claim_attempt(self) -> str:
        """The attempt id this process is recorded under, its ledger created now if start() has not created it yet.

        An id whose ledger exists already (a requeued job passing its scheduler's id again) becomes ``<id>.2``...
        here, with a warning: `goodput_resource` (the OpenTelemetry resource, made before start()) calls it, so that
        the resource names the attempt the ledger records. A tracker claimed but never started leaves an empty
        ledger, which the reports leave out with a warning, as one of a process that died in start()."""
        with self._lock:
            if self._writer is None:
                self._writer = LedgerWriter(
                    self.root, self.attempt_id, self.rank, self.storage_options, upload_interval=self._upload_interval
                )
                if self._writer.attempt != self.attempt_id:
                    log.warning(
                        "goodput: attempt %r of rank %d has a ledger already (an earlier process given the same "
                        "attempt_id): this one is recorded as attempt %r",
                        self.attempt_id,
                        self.rank,
                        self._writer.attempt,
                    )
                    self.attempt_id = self._writer.attempt
                _HOLDING.add(self)
            return self.attempt_id

    def _in_forked_child(self) -> None:
        """Called in a forked child: the tracker is its parent's. Every record is refused from now on, naming both
        processes (`LedgerWriter.forked`), and its metrics stop reporting the checkpoint gauges: the child's copy of
        the SDK exports too (its periodic reader restarts in a child), and a DataLoader worker reported a last step
        frozen at the fork and an age growing beside the parent's, in the same series. The lock is new: a thread of
        the parent may have held it at the fork, and no thread of the parent runs in the child to release it."""
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)
        self._loading = False
        self.metrics.end()
        self._writer.forked()
        if self._started:
            self._mono = self._refuse

    def use_metrics(self, metrics: GoodputMetrics) -> None:
        """Report to `metrics` from now on (e.g. instruments of a provider configured after the tracker was made)."""
        if self._started:
            metrics.bind(job=self.job_id, attempt=self.attempt_id, rank=self.rank, now_us=self._now)
        if metrics is not self.metrics:
            if self.metrics.last_commit is not None:  # the newest checkpoint so far, for its step and age gauges
                metrics.committed(*self.metrics.last_commit)
            self.metrics.end()
            self._exported = {}  # the new attempt counters get this attempt's whole time at the next export
        self.metrics = metrics

    def use_run_id(self, run_id: str) -> None:
        """The run id of the CheckpointManager this tracker reports to (`ckpt.run`: its run_id=, the launcher's, or
        one it generated): the job id from now on, unless job_id= or the environment named the job. Told when the
        tracker is handed to the manager, before the first save or restore; metrics are labelled with it anew.

        Told once the metrics have points labelled with the job (a tracker handed to a manager after its first
        steps, or to a second manager with another run id), the job stays as it is, with a warning naming both ids:
        the SDK goes on exporting a series it has, so a new job id would leave the old one's series beside the new,
        frozen at their last values (a second job in every dashboard and alert)."""
        with self._lock:
            if self._job_known or not run_id or run_id == self.job_id:
                return
            if self.metrics.recorded:
                log.warning(
                    "goodput: run id %r told after points were labelled with job %r, which they keep (a new job "
                    "would leave the old one's series exported beside its own). Name the job (job_id=, ETTR_JOB_ID "
                    "or the launcher's run id), or hand the tracker to the CheckpointManager before its first step",
                    str(run_id),
                    self.job_id,
                )
                return
            self.job_id = str(run_id)
            if self._started:
                self.metrics.bind(job=self.job_id, attempt=self.attempt_id, rank=self.rank, now_us=self._now)

    def end(self, status: str = "ok") -> None:
        """Mark a clean end (or status="error"), flush and close the ledger. Every record after it is refused with
        a ValueError naming the ledger, a second end() too; `totals_us()` stays at the totals of the end."""
        if not isinstance(status, str):
            raise TypeError(f"status must be a string ('ok' or 'error'), got {type(status).__name__} {status!r}")
        t = self._now()  # refused before start() and after end()
        window = self._windows.close()  # the window in progress, partial or not
        if window is not None:
            self.metrics.set_step_window(*window)
        self._buf.append({"k": "end", "t": t, "status": status})
        self._resume_known = True
        self.flush()
        with self._lock:
            while self._loading:  # another thread reads the earlier attempts: its export comes before the end
                self._loaded.wait()
        self.metrics.end()
        with self._lock:
            self._writer.close()
            _HOLDING.discard(self)
            self._ended = self._last_flush
            self._mono = self._refuse  # a step, a span or a checkpoint hook from now on is an error, not a lost record

    def _refuse(self) -> int:
        """The clock of an ended tracker (or of a forked child's copy): it raises the ledger's refusal
        (`LedgerWriter.check_open`), so every record fails at its call, as one handed to the closed ledger does,
        instead of waiting in memory for a flush that never comes (a span, a delete, a step's begin were kept and
        lost in silence)."""
        self._writer.check_open()
        raise AssertionError("unreachable: the ledger is closed")

    def __enter__(self) -> GoodputTracker:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.end("ok" if exc_type is None else "error")

    # -- the step path ---------------------------------------------------------------------------------------
    def _now(self) -> int:
        """Microseconds on the job timeline: this attempt's wall start plus monotonic time since."""
        return self._mono() + self._offset

    def _credit(self) -> int:
        """Give the time since the last event to the innermost open interval (or the gap category); returns now."""
        t = self._mono() + self._offset
        self._acc[self._stack[-1][1] if self._stack else self._gap] += t - self._last
        self._last = t
        return t

    def step_begin(self, step: int) -> None:
        """A training step starts."""
        step = _integer("step", step)
        with self._lock:  # the manager's hooks may open spans from another thread
            t = self._credit()
            self._gap = "other"
            self._order += 1
            self._stack.append([self._order, "productive", step, t, None])

    def step_end(
        self, step: int, loss: Any = None, *, batch: str | None = None, scalars: dict[str, Any] | None = None
    ) -> None:
        """A training step ends: its record goes to the OS now; flushes once the last flush is flush_interval old.

        `loss` (a float, or a 0-dim tensor: ``float()`` reads it, which waits for a device's kernels), `batch` (the
        batch hash, e.g. ``sampler.batch_hash(step)``) and `scalars` ({name: number}) go into the record as its
        digest: a step trained again after a resume is compared with it bit for bit (docs/goodput.md, replay)."""
        step = _integer("step", step)
        refused: TypeError | None = None
        if loss is None and batch is None and not scalars:
            found = digest = None
        else:
            try:
                found, digest = _digest(loss, batch, scalars)
            except TypeError as e:  # raised once the step is ended: an open step would take the time after it
                found = digest = None
                refused = e
        self._end_step(step, found, digest)
        if refused is not None:
            raise refused

    def _end_step(self, step: int, found: tuple | None, digest: str | None) -> None:
        """`step_end` past its checks: the step's record (with its digest's fields, if any) goes to the OS."""
        with self._lock:
            t = self._credit()
            stack = self._stack
            top = stack[-1] if stack else None
            entry = stack.pop() if top is not None and top[2] == step and top[1] == "productive" else self._pop(step)
            record = (step, entry[3], t, entry[0]) if digest is None else (step, entry[3], t, entry[0], digest)
            if self._through is not None and step <= self._through:  # a step trained again: compared at the flush
                self._replayed.append((step, found))
            window = self._windows.step(step, t - entry[3])
            if window is not None:
                self.metrics.set_step_window(*window)
            due = t - self._last_flush >= self._flush_us
            if not (due or self._buf):  # the common case: nothing buffered to go before it
                self._writer.append((_STEP if digest is None else _STEP_DIGEST) % record)
                return
            self._buf.append(record)
            if not due:
                self._hand_off()
                return
            load = self._write_out(force=False)
        if load:
            self._load_prior()

    def step(self, step: int) -> _Step:
        """`with tracker.step(i):` around one training step."""
        return _Step(self, _integer("step", step))

    def span(self, category: str, **attrs: Any) -> _Span:
        """`with tracker.span("data_wait"):` time a category; checkpoint_save/restore flush at both ends.

        A span opened directly inside an open span of the same category is part of it (one record): an
        integration's save around the manager's save is one checkpoint_save.

        The category must be a non-empty str and the attributes JSON (0-d tensors and numpy scalars become numbers):
        anything else is refused here, before a record is written, since one bad record makes the ledger unreadable.
        """
        if not isinstance(category, str):
            raise TypeError(f"span category must be a string, got {type(category).__name__} {category!r}")
        if not category:
            raise ValueError("span category must be a non-empty string, got ''")
        if category in ("productive", "lost", "downtime", "startup"):
            raise ValueError(f"{category!r} is derived by attribution, not a span category")
        if attrs:
            attrs = _json_attrs(attrs)
            part = attrs.get("part") if category == "checkpoint_save" else None
            if part is not None and part not in SAVE_PARTS:
                raise ValueError(f"part of a checkpoint_save must be one of {', '.join(SAVE_PARTS)}, got {part!r}")
            if category == "checkpoint_save" and attrs.get("step") is not None:
                _integer("step of a checkpoint_save", attrs["step"])  # the ledger's reader requires it
        return _Span(self, category, attrs)

    def _open(self, category: str, step: int | None, attrs: dict[str, Any]) -> list[Any] | None:
        """Push a span onto the open stack; None inside an open span of the same category (it is part of that one),
        unless it names a part of a save (``part=``, SAVE_PARTS): the wait for the previous save inside save() is a
        span of its own within the save's, so that attribution can split the save's seconds (`span` checked it)."""
        part = attrs.get("part") if category == "checkpoint_save" else None
        with self._lock:
            top = self._stack[-1] if self._stack else None
            if top is not None and top[1] == category and (part is None or top[4].get("part") == part):
                return None
            t = self._credit()
            self._order += 1
            entry = [self._order, category, step, t, attrs]
            self._stack.append(entry)
            # a part inside an open save: the save's own span flushes at both ends
            load = category in FLUSHED_SPANS and not (top is not None and top[1] == category) and self._write_out(True)
        if load:
            self._load_prior()
        return entry

    def _close(self, entry: list[Any] | None) -> None:
        """Pop a span, buffer its record, feed the duration histograms (a save's, or its part's)."""
        if entry is None:
            return
        load = False
        with self._lock:
            t = self._credit()
            if self._stack[-1] is entry:
                self._stack.pop()
            else:
                self._stack.remove(entry)
            order, category, _, begin, attrs = entry
            self._buf.append((category, begin, t, order, attrs))
            if category == WAIT and any(e[1] == "productive" for e in self._stack):
                self._windows.waited(t - begin)
            if category in FLUSHED_SPANS:
                inside = bool(self._stack) and self._stack[-1][1] == category  # a part inside an open save
                part = attrs.get("part") if category == "checkpoint_save" else None
                self.metrics.record_duration(SAVE_PARTS[part] if part else category, (t - begin) / 1e6)
                if category == "checkpoint_save":
                    self._split[part or "stall"] += t - begin
                    if part == "previous_wait" and inside:
                        self._split["stall"] -= t - begin  # the open save counts all of its time when it closes
                load = not inside and self._write_out(True)
        if load:
            self._load_prior()

    def _pop(self, step: int) -> list[Any]:
        """Remove the open step `step` from the stack when it is not on top (a span left open inside it)."""
        for i in range(len(self._stack) - 1, -1, -1):
            entry = self._stack[i]
            if entry[1] == "productive" and entry[2] == step:
                return self._stack.pop(i)
        raise ValueError(f"step_end({step}) without a matching step_begin({step})")

    # -- the checkpoint manager's hooks (may run on its writer thread) ----------------------------------------
    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int | None = None, *, tier: str | None = None
    ) -> None:
        """The manager made the checkpoint of `step` (`nbytes` of tensor data) durable after `background_seconds`
        of background work; `tier` names the tier it reached (TIERS; None: the only one)."""
        step = _integer("step", step)
        background_seconds = check_seconds("background_seconds", background_seconds)
        nbytes = None if nbytes is None else _integer("nbytes", nbytes)
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative integer or None, got {nbytes!r}")
        t = self._now()
        self._buf.append({"k": "commit", "s": step, "t": t, "bg": background_seconds, **_tier(tier)})
        with self._lock:
            self._split["background_write"] += round(background_seconds * 1e6)  # as attribution rounds it
        self.metrics.committed(step, t, background_seconds, nbytes, tier)
        self.flush()

    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None:
        """The manager restored `step` (None: no checkpoint, a fresh start) from `tier` (TIERS; None: the only one);
        attribution classes the failure before it by the tier (docs/goodput.md)."""
        step = None if step is None else _integer("step", step)
        self._buf.append({"k": "restore", "s": step, "t": self._now(), **_tier(tier)})
        self._resume_known = True
        self.flush()

    def checkpoint_deleted(self, step: int, *, tier: str | None = None) -> None:
        """The manager deleted the committed checkpoint of `step` (retention, or delete()) from `tier` (TIERS; None:
        the only one): the report tells it from the retained ones. Goes to the ledger with the next records."""
        step = _integer("step", step)
        self._buf.append({"k": "delete", "s": step, "t": self._now(), **_tier(tier)})

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        """A background checkpoint write failed; it will not count as committed."""
        step = _integer("step", step)
        self._buf.append({"k": "ckpt_failed", "s": step, "t": self._now(), "err": f"{type(error).__name__}: {error}"})
        self.flush()

    # -- flushing and live totals ---------------------------------------------------------------------------
    def _hand_off(self, *extra: str) -> None:
        """Hand the buffered records (and `extra` lines) to the ledger writer; call with the lock held."""
        buf = self._buf
        if buf or extra:  # popleft only what is there now: a record appended meanwhile goes with the next hand-off
            self._writer.append("".join([_encode(buf.popleft()) for _ in range(len(buf))] + list(extra)))

    def flush(self, force: bool = True) -> None:
        """Write buffered records and a heartbeat listing open intervals, make them durable (fsync, or a segment
        PUT); export live totals to OpenTelemetry. `force=False` (the periodic flush) lets an object-store ledger
        wait for its `upload_interval`: the records stay in memory, no heartbeat is added. The first flush after the
        resume is known reads the earlier attempts' ledgers, without the lock (`_load_prior`)."""
        with self._lock:
            load = self._write_out(force)
        if load:
            self._load_prior()

    def _write_out(self, force: bool) -> bool:
        """`flush` with the lock held; True when the earlier attempts are to be read now, which the caller does with
        `_load_prior` once it has released the lock."""
        t = self._now()
        if force or self._writer.due(t):
            stack = [
                (("step", e[2]) if e[1] == "productive" else ("span", e[1])) + (e[3], e[0]) for e in list(self._stack)
            ]
            self._hand_off(_encode({"k": "alive", "t": t, "open": stack}))
            self._writer.sync(t)
        else:
            self._hand_off()
        self._last_flush = t
        if self._prior_done:
            self._export(t)
            self._verify()
            return False
        if self._loading or not (self._resume_known or self._gap == "other"):
            return False
        self._loading = True
        self._through = _EVERY_STEP  # while they are read, every step ended is kept for the comparison
        return True

    def _load_prior(self) -> None:
        """Once this attempt's resume point is on disk, attribute the earlier attempts (for job-level telemetry) and
        export. Call without the lock: reading and attributing a long job's ledgers takes seconds (3.7 s for 300k
        steps), which the steps of a training thread must not wait for; they go on meanwhile."""
        try:
            try:
                prior = _earlier_attempts(self.root, self.storage_options, self.rank)
            except BaseException:
                with self._lock:  # tried once, as before: telemetry counts this attempt only
                    self._use_prior(_Prior(None, None, {}, {}, None, {}))
                raise
            with self._lock:
                self._use_prior(prior)
                self._export(self._now())
                self._verify()
        finally:  # whatever was raised: no replay() or end() waits for a read that is over
            with self._lock:
                self._loading = False
                self._loaded.notify_all()

    def _use_prior(self, prior: _Prior) -> None:
        """Take the earlier attempts' figures; call with the lock held."""
        if prior.newest_commit is not None:  # the job's newest checkpoint so far, for the last-step and age gauges
            self.metrics.committed(*prior.newest_commit)
        self._through = None
        if prior.attribution is not None:
            self._prior = prior.attribution
            self._earlier, self._earlier_split = prior.earlier, prior.earlier_split
            self._overlap = prior.overlap_us
            self._shift = prior.shift_us
            self._expect = prior.expect
            me = prior.attribution.attempts[-1]
            self._through = me.replay.through
            self._report_replay(me.replay)
        # of the steps ended while the ledgers were read, those the read missed are still in `_expect`: kept as the
        # steps ended from now on are (up to `_through`)
        through = self._through
        self._replayed = [] if through is None else [r for r in self._replayed if r[0] <= through]
        self._failures = prior.failures
        self._prior_done = True

    def replay(self) -> Replay:
        """This attempt's replay verification so far: the steps it trained again after its resume, compared bit
        for bit with their first pass in the earlier attempts' ledgers (the ones ended since the last flush too).
        `Replay.text()` says ``replayed 50 step(s): 50 bitwise equal``; `Replay.through` is the last step still to
        be trained again (None once all are)."""
        if not self._prior_done:
            self.flush()
        with self._lock:
            while self._loading:  # another thread reads the earlier attempts
                self._loaded.wait()
            self._verify()
            return self._replay

    def _verify(self) -> None:
        """Compare the steps trained again since the last call with their first pass; call with the lock held."""
        if not self._replayed:
            return
        found = compare(self._expect, self.attempt_id, self._replayed, self.root)  # pops what it compared
        self._replayed = []
        if not self._expect:
            self._through = None
        self._report_replay(found)

    def _report_replay(self, found: Replay) -> None:
        """Add a comparison to this attempt's replay and its metrics; a first divergence is a logged warning."""
        first = self._replay.first_divergence is None and found.first_divergence is not None
        self._replay = dataclasses.replace(self._replay + found, pending=self._expect)
        d = found.first_divergence
        self.metrics.replayed(found.replayed, found.diverged, d.step if first else None)
        if first:
            log.warning(
                "replay diverged at step %d: %s (attempt %s against %s); its batch: %s",
                d.step,
                d.text(),
                d.attempt,
                d.first_attempt,
                d.explain,
            )

    def totals_us(self, at_us: int | None = None) -> dict[str, int]:
        """Job-level microseconds per category as this process sees them: earlier attempts plus this one live (after
        end(), as at its end)."""
        with self._lock:
            t = at_us if at_us is not None else self._ended if self._ended is not None else self._now()
            acc = dict(self._acc)
            top = self._stack[-1][1] if self._stack else self._gap
            acc[top] = acc.get(top, 0) + t - self._last
        for cat, us in self._earlier.items():
            acc[cat] = acc.get(cat, 0) + us
        return acc

    def _export(self, t: int) -> None:
        """Count what this attempt's own time grew by since the last export, set the job totals and ETTR gauges."""
        totals = self.totals_us(t)
        for cat, us in totals.items():
            mine = us - self._earlier.get(cat, 0)
            if mine > self._exported.get(cat, 0):
                self.metrics.add_attempt_seconds(cat, (mine - self._exported.get(cat, 0)) / 1e6)
                self._exported[cat] = mine
        self.metrics.set_job_seconds({cat: us / 1e6 for cat, us in totals.items() if us})
        if self._failures is not None:  # again each time: metrics configured after the restore get it too
            self.metrics.set_failures(self._failures)
        with self._lock:
            split = {part: us + self._earlier_split.get(part, 0) for part, us in self._split.items()}
        self.metrics.set_checkpoint_seconds({part: us / 1e6 for part, us in split.items()})
        # the ratios are taken on the job's timeline, as attribution's: this attempt's clock moved by `_shift` (a
        # wall clock that went back gave 0.0, or a ratio above 1, beside the report's); its history is kept in its own
        job_start = self._prior.start_us if self._prior is not None else self._start
        now = t + self._shift
        begin = max(job_start, now - round(self.window_s * 1e6))
        own = totals.get("productive", 0) - self._earlier.get("productive", 0)
        history = self._history
        if len(history) > 1 and t - history[-2][0] < self._history_gap:
            history[-1] = (t, own)  # the last snapshot moves on: the one before it is less than a gap older
        else:
            history.append((t, own))
        while len(history) > 1 and history[1][0] <= begin - self._shift:
            history.popleft()  # keep the newest snapshot at or before the window's start
        own_before = history[0][1] if history[0][0] <= begin - self._shift else 0
        # the earlier attempts' productive time up to where the timeline starts this attempt
        starts = self._start + self._overlap + self._shift
        earlier = self._prior.productive_us_between(begin, starts) if self._prior else 0
        self.metrics.set_ettr(
            totals.get("productive", 0) / (now - job_start) if now > job_start else 0.0,
            (earlier + own - own_before) / (now - begin) if now > begin else 0.0,
            self.window_s,
        )
