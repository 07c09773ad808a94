"""Pure attribution: ledger records + committed steps -> microseconds per category, summing to the job's wall time."""

from __future__ import annotations

import dataclasses
import functools
import heapq
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .formulas import check_window
from .ledger import SAVE_PARTS, Ledger, LedgerError, ledger_dir, ledger_ranks, no_ledgers, read_ledgers, root_of
from .replay import Digest, FirstPasses, Replay, compare

LOCAL_TIERS = ("local", "peer")  # a restore from these means the local tier (with its replicas) survived

CATEGORIES = (
    "productive",
    "checkpoint_save",
    "checkpoint_restore",
    "startup",
    "lost",
    "downtime",
    "data_wait",
    "other",
)
DOWNTIME = -1  # attempt index of a downtime segment
# How checkpoint_save's seconds split (Attribution.checkpoint_split): save()'s own stall, its wait for the previous
# save, an optimizer step's wait for an overlapped snapshot
SAVE_SPLIT = ("stall", *SAVE_PARTS)
_PART_LABEL = "checkpoint_save/"  # the sweep's label of a save part
_INF = float("inf")


@dataclass(frozen=True)
class Segment:
    """A stretch of the job's timeline [begin_us, end_us) spent in one category by one attempt (DOWNTIME between)."""

    begin_us: int
    end_us: int
    category: str
    attempt: int


@dataclass(frozen=True)
class AttemptSummary:
    """One process attempt: where it sits on the timeline, how it ended, where it resumed, what it cost."""

    attempt: str
    rank: int
    source: str
    start_us: int
    end_us: int
    status: (
        str  # "ok" (clean end), "error" (ended by an exception), "failed" (vanished, a later attempt exists), "running"
    )
    restored_step: int | None
    first_step: int | None
    last_step: int | None
    steps: int
    lost_steps: int
    micros: dict[str, int]
    torn: bool
    restored_tier: str | None = None  # the restore record's tier (None: one tier, or nothing restored)
    restore_us: int = 0  # its checkpoint_restore spans, end minus begin
    failure_class: str | None = None  # a failed attempt's class: "local", "node" or None (unknown); see failure_class
    checkpoint_split_us: dict[str, int] = field(default_factory=dict)  # its checkpoint_save micros per SAVE_SPLIT part
    saves: int = 0  # its save() calls (checkpoint_save spans that are no part of a save)
    background_us: int = 0  # its commits' background seconds (beside the sum, as Attribution.background_us)
    replay: Replay = field(default_factory=Replay)  # the steps it trained again after its resume, compared

    @property
    def failed(self) -> bool:
        """True if this attempt ended in a failure."""
        return self.status in ("failed", "error")


@dataclass(frozen=True)
class Attribution:
    """Where a job's wall time went. `micros` sums exactly to `wall_us`; background checkpoint time is beside it."""

    start_us: int
    end_us: int
    micros: dict[str, int]
    attempts: tuple[AttemptSummary, ...]
    segments: tuple[Segment, ...]
    background_us: int
    committed_steps: tuple[int, ...]  # every step the job committed, the deleted ones too
    save_us: tuple[int, ...] = field(repr=False)
    restore_us: tuple[int, ...] = field(repr=False)
    window_s: float = 3600.0
    deleted_steps: tuple[int, ...] = ()  # committed steps deleted since (retention, delete()), by the ledgers
    # (step, time) of the newest commit the ledgers record (the highest step, its latest commit), the time on the
    # job's timeline as the attempts are placed (a wall clock that went back moves a later attempt's commits with it),
    # so `end_us - newest_commit[1]` is the checkpoint's age at the job's last record; None without a commit record
    newest_commit: tuple[int, int] | None = None

    @property
    def retained_steps(self) -> tuple[int, ...]:
        """Committed steps not deleted since, as far as the ledgers tell (`delete` records; a ledger written before
        them, or a process killed before recording a delete, leaves a deleted step listed here)."""
        deleted = set(self.deleted_steps)
        return tuple(s for s in self.committed_steps if s not in deleted)

    @property
    def wall_us(self) -> int:
        """First attempt's start to the last attempt's last sign of life."""
        return self.end_us - self.start_us

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per category."""
        return {k: v / 1e6 for k, v in self.micros.items()}

    @property
    def checkpoint_split_us(self) -> dict[str, int]:
        """checkpoint_save's microseconds split (SAVE_SPLIT, summing to it): "stall", the time in save() besides
        "previous_wait", its wait for the previous save to finish; "overlap_wait", optimizer steps' waits for an
        overlapped snapshot (snapshot="overlap"). The background write is not among them: see background_us."""
        out = dict.fromkeys(SAVE_SPLIT, 0)
        for a in self.attempts:
            for part, us in a.checkpoint_split_us.items():
                out[part] += us
        return out

    @property
    def save_cost_s(self) -> float:
        """Seconds of training one save costs, the checkpoint interval model's T_write: its stall plus the optimizer
        steps' waits for its overlapped snapshot, per save (0 without saves). The wait for the previous save is left
        out: it is what an interval shorter than the background write costs, and the model's longer interval
        removes it; the background write itself overlaps training."""
        split = self.checkpoint_split_us
        return (split["stall"] + split["overlap_wait"]) / 1e6 / self.saves if self.saves else 0.0

    @property
    def saves(self) -> int:
        """Calls of save() in the job (one per checkpoint taken; the waits that are parts of a save not counted)."""
        return len(self.save_us)

    @property
    def replay(self) -> Replay:
        """Every step trained a second time after a resume, compared with its first pass (docs/goodput.md)."""
        total = Replay()
        for a in self.attempts:
            total += a.replay
        return total

    @property
    def failures(self) -> int:
        """Attempts that ended in a failure."""
        return sum(a.failed for a in self.attempts)

    @property
    def failure_classes(self) -> dict[str, int]:
        """Failed attempts per class: the local tier survived them, or not (node), or the ledgers cannot tell."""
        classes = [a.failure_class for a in self.attempts if a.failed]
        return {
            "local": classes.count("local"),
            "node": classes.count("node"),
            "unclassified": classes.count(None),
        }

    @property
    def restores_per_tier(self) -> dict[str | None, tuple[int, float]]:
        """Tier (None: untiered) -> (restores of a step from it, their checkpoint_restore seconds) (`restores`)."""
        tiers = dict.fromkeys(a.restored_tier for a in self.attempts if a.restored_step is not None)
        return {tier: (len(self.restores([tier])), sum(self.restores([tier]))) for tier in tiers}

    def restores(self, tiers: Iterable[str | None] | None = None) -> list[float]:
        """Seconds of each restore of a step (of those from `tiers` when given; None in it: untiered), one per
        attempt that restored one: its checkpoint_restore spans together (a fallback from one tier to another is
        one restore). A fresh start's look for a checkpoint is none. The one owner of "mean restore time":
        `mean_restore_s`, used by the report and the advice alike."""
        wanted = None if tiers is None else set(tiers)
        return [
            at.restore_us / 1e6
            for at in self.attempts
            if at.restored_step is not None and (wanted is None or at.restored_tier in wanted)
        ]

    def mean_restore_s(self, tiers: Iterable[str | None] | None = None) -> float | None:
        """Mean seconds per restore of a step (`restores`); None without one."""
        found = self.restores(tiers)
        return sum(found) / len(found) if found else None

    @property
    def ettr(self) -> float:
        """Cumulative effective training time ratio: productive / wall."""
        return self.micros["productive"] / self.wall_us if self.wall_us else 0.0

    def ettr_window(self, window_s: float | None = None) -> float:
        """ETTR over the last `window_s` seconds of the job (default: self.window_s)."""
        w = round((self.window_s if window_s is None else check_window("window_s", window_s)) * 1e6)
        begin = max(self.start_us, self.end_us - w)
        return self.productive_us_between(begin, self.end_us) / (self.end_us - begin) if self.end_us > begin else 0.0

    def productive_us_between(self, begin_us: int, end_us: int) -> int:
        """Productive microseconds within [begin_us, end_us)."""
        return sum(
            max(0, min(s.end_us, end_us) - max(s.begin_us, begin_us))
            for s in self.segments
            if s.category == "productive"
        )

    def ettr_curve(self) -> list[tuple[int, float]]:
        """(time, cumulative ETTR up to then) at the end of every segment, for plotting."""
        points, productive = [], 0
        for s in self.segments:
            productive += (s.end_us - s.begin_us) if s.category == "productive" else 0
            if s.end_us > self.start_us:
                points.append((s.end_us, productive / (s.end_us - self.start_us)))
        return points

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no segments)."""
        return {
            "wall_seconds": self.wall_us / 1e6,
            "seconds": self.seconds,
            "background_checkpoint_seconds": self.background_us / 1e6,
            "saves": self.saves,
            "checkpoint_save_split": {part: us / 1e6 for part, us in self.checkpoint_split_us.items()},
            "ettr": self.ettr,
            "ettr_window": self.ettr_window(),
            "window_seconds": self.window_s,
            "failures": self.failures,
            "failure_classes": self.failure_classes,
            "restores_per_tier": {
                tier or "untiered": {"restores": n, "seconds": sec} for tier, (n, sec) in self.restores_per_tier.items()
            },
            "restores": len(self.restores()),
            "mean_restore_seconds": self.mean_restore_s(),
            "committed_steps": list(self.committed_steps),
            "retained_steps": list(self.retained_steps),
            "deleted_steps": list(self.deleted_steps),
            "replay": self.replay.to_dict(),
            "attempts": [
                {
                    "attempt": a.attempt,
                    "rank": a.rank,
                    "status": a.status,
                    "start_us": a.start_us,
                    "end_us": a.end_us,
                    "restored_step": a.restored_step,
                    "restored_tier": a.restored_tier,
                    "failure_class": a.failure_class,
                    "first_step": a.first_step,
                    "last_step": a.last_step,
                    "steps": a.steps,
                    "lost_steps": a.lost_steps,
                    "torn": a.torn,
                    "seconds": {k: v / 1e6 for k, v in a.micros.items()},
                    "saves": a.saves,
                    "checkpoint_save_split": {part: us / 1e6 for part, us in a.checkpoint_split_us.items()},
                    "replay": a.replay.to_dict(),
                }
                for a in self.attempts
            ],
        }


@dataclass(eq=False)  # identity: _timeline finds attempts in lists; field-by-field equality made that quadratic
class _Attempt:
    """What attribution needs from one ledger, gathered in one pass."""

    ledger: Ledger  # its start record only: the others are gathered into the fields below
    start: int  # dated from the process's start (imports count as startup)
    last: int
    seen: int  # its first record after the start: when it began recording
    # begin, end, order, category or "step", step (a step) or the save part (a checkpoint_save span; None: its stall)
    intervals: list[tuple[int, int, int, str, Any]]
    restored: tuple[bool, int | None]  # (had a restore record, step)
    restored_tier: str | None
    commits: list[tuple[int, int, str | None]]  # (step, background microseconds, tier)
    commit_times: dict[int, int]  # step -> wall time of its commit record
    events: list[tuple[str, int, str | None]]  # ("commit" | "delete", step, tier) in the ledger's order
    status: str | None
    save_us: list[int]
    restore_us: list[int]
    digests: dict[int, Digest | None] = field(default_factory=dict)  # step -> its first record's digest
    # (time, step) of each restore record: one after steps (a rollback in the process) throws the steps above it away
    rollbacks: list[tuple[int, int | None]] = field(default_factory=list)
    # `_labelled`'s last answer and the placement it was for, (k, end, lost_after): that one is not swept again
    swept: tuple[tuple[int, int, float], Any] | None = field(default=None, init=False, repr=False)

    @functools.cached_property
    def step_range(self) -> tuple[int | None, int | None, int]:
        """Its first and last step (None without one) and how many it trained."""
        steps = [s for *_, c, s in self.intervals if c == "step"]
        return min(steps, default=None), max(steps, default=None), len(steps)

    @functools.cached_property
    def first_step(self) -> tuple[int, int] | None:
        """(begin, step) of the earliest step."""
        steps = [(b, s) for b, _, _, c, s in self.intervals if c == "step"]
        return min(steps) if steps else None


def _gather(ledger: Ledger) -> _Attempt:
    """Collect intervals (closed, and open ones from the last heartbeat) and events of one ledger."""
    closed: dict[int, tuple[int, int, int, str, int | None]] = {}
    open_: dict[int, tuple[str, Any, int]] = {}
    start = ledger.records[0]["t"]
    legacy = ledger.records[0].get("v", 1) < 2  # before save parts: an optimizer step's wait was a plain save span
    saved: set[Any] = set()  # steps whose save() span was seen (legacy: a later span of the same step is a wait)
    last = start
    restored: tuple[bool, int | None] = (False, None)
    restored_tier = None
    commits, save_us, restore_us, status = [], [], [], None
    commit_times: dict[int, int] = {}
    events: list[tuple[str, int, str | None]] = []
    digests: dict[int, Digest | None] = {}
    rollbacks: list[tuple[int, int | None]] = []
    for r in ledger.records:
        k = r["k"]
        last = max(last, r.get("e", r.get("t", last)))
        if k == "step":
            closed[r["o"]] = (r["b"], r["e"], r["o"], "step", r["s"])
            if r["s"] not in digests:
                digests[r["s"]] = Digest.of(r) if len(r) > 5 else None
        elif k == "span":
            part = None
            if r["c"] == "checkpoint_save":
                attrs = r.get("a", {})
                part = attrs.get("part") if attrs.get("part") in SAVE_PARTS else None
                step = attrs.get("step")
                if part is None and legacy and step is not None and step in saved:
                    part = "overlap_wait"
                if part is None:
                    save_us.append(r["e"] - r["b"])
                    saved.add(step)
            elif r["c"] == "checkpoint_restore":
                restore_us.append(r["e"] - r["b"])
            closed[r["o"]] = (r["b"], r["e"], r["o"], r["c"], part)
        elif k == "alive":
            open_ = {o: (kind, name, b) for kind, name, b, o in r["open"]}
        elif k == "commit":
            commits.append((r["s"], round(r["bg"] * 1e6), r.get("tier")))
            commit_times[r["s"]] = r["t"]
            events.append(("commit", r["s"], r.get("tier")))
        elif k == "delete":
            events.append(("delete", r["s"], r.get("tier")))
        elif k == "restore":
            restored, restored_tier = (True, r["s"]), r.get("tier")
            rollbacks.append((r["t"], r["s"]))
        elif k == "end":
            status = r["status"]
    intervals = list(closed.values())
    for o, (kind, name, b) in open_.items():
        if o not in closed:
            intervals.append((b, last, o, "step" if kind == "step" else name, name if kind == "step" else None))
    seen = ledger.began_us
    return _Attempt(
        dataclasses.replace(ledger, records=ledger.records[:1]),  # the records are gathered below, not kept twice
        start,
        last,
        seen,
        intervals,
        restored,
        restored_tier,
        commits,
        commit_times,
        events,
        status,
        save_us,
        restore_us,
        digests,
        rollbacks,
    )


def _shifted(a: _Attempt, delta: int) -> _Attempt:
    """The same attempt `delta` microseconds later on the job's timeline."""
    return dataclasses.replace(
        a,
        start=a.start + delta,
        last=a.last + delta,
        seen=a.seen + delta,
        intervals=[(b + delta, e + delta, o, c, s) for b, e, o, c, s in a.intervals],
        commit_times={s: t + delta for s, t in a.commit_times.items()},
        rollbacks=[(t + delta, s) for t, s in a.rollbacks],
    )


def _timeline(attempts: list[_Attempt]) -> list[_Attempt]:
    """The attempts in the order they ran, none starting before causality allows.

    Wall clocks can go back between attempts (an NTP step, a node with a wrong clock). An attempt that restored a
    step runs after the attempt that committed it. One that began recording before the previous attempt's start, or
    before the commit of the step it restored, is placed right at the previous attempt's last record, with every
    later attempt moved by as much: no downtime is invented (the real gap is unknown), and a warning says so. An
    attempt whose process started (imports, startup) while the previous one still recorded, e.g. a second tracker in
    the same process, starts at the previous one's last record. Two attempts recording at once (two processes of one
    rank on one root) are counted as they are placed, the earlier one up to the later one's start, with a warning.

    They are ordered by when they began recording (`seen`), not by their process's start: that is read from clock
    ticks of 10 ms, so two trackers of one process got starts some milliseconds apart in either order, and the
    second one was put first half the time (its steps then fell in the first one's span and vanished).
    """
    order = sorted(attempts, key=lambda a: (a.seen, a.start, a.ledger.attempt))
    committers: dict[int, list[_Attempt]] = {}
    for a in order:
        for s in a.commit_times:
            committers.setdefault(s, []).append(a)

    def source(a: _Attempt) -> _Attempt | None:
        """The attempt whose commit `a` restored. A step re-run after a rollback is committed again: of its
        committers, the latest one placed before `a`, else the first."""
        if not a.restored[0]:
            return None
        candidates = [c for c in committers.get(a.restored[1], ()) if c is not a]
        before = [c for c in candidates if order.index(c) < order.index(a)]
        if before:
            return max(before, key=order.index)
        return candidates[0] if candidates else None

    for _ in range(len(order)):  # each move puts an attempt after its source; a cycle cannot loop forever
        late = next((a for i, a in enumerate(order) if source(a) is not None and order.index(source(a)) > i), None)
        if late is None:
            break
        src = source(late)
        order.remove(late)
        order.insert(order.index(src) + 1, late)
    placed: dict[int, _Attempt] = {}  # id of the original -> the attempt as placed on the timeline
    out: list[_Attempt] = []
    offset = 0
    for a in order:
        here = _shifted(a, offset) if offset else a
        if out:
            prev, src = out[-1], source(a)
            restored_at = placed[id(src)].commit_times[a.restored[1]] if src is not None and id(src) in placed else None
            if here.seen < prev.start or (restored_at is not None and here.seen < restored_at):
                delta = prev.last - here.start
                warnings.warn(
                    f"attempt {a.ledger.attempt} ({a.ledger.source}) starts {delta / 1e6:.3f} s before the "
                    f"end of attempt {prev.ledger.attempt} although it ran after it (its wall clock went "
                    f"back): placed right after it, with no downtime between them",
                    RuntimeWarning,
                )
                offset += delta
                here = _shifted(here, delta)
            elif here.start < prev.last <= here.seen:
                here = dataclasses.replace(here, start=prev.last)
            elif here.seen < prev.last:  # both recording at once: counted as before, but no longer in silence
                warnings.warn(
                    f"attempt {a.ledger.attempt} ({a.ledger.source}) began recording "
                    f"{(prev.last - here.seen) / 1e6:.3f} s before attempt {prev.ledger.attempt} ({prev.ledger.source}) "
                    f"recorded its last: two processes of rank {a.ledger.rank} wrote to one root at once (a hung one "
                    f"still writing, or a second job on this root); {prev.ledger.attempt} is counted up to where "
                    f"{a.ledger.attempt} starts",
                    RuntimeWarning,
                )
                if here.start < prev.start:  # its process started first: cut there, prev would end before it began
                    here = dataclasses.replace(here, start=prev.start)
        placed[id(a)] = here
        out.append(here)
    return out


def placed(ledgers: Iterable[Ledger]) -> list[Ledger]:
    """One rank's ledgers in the order attribution places their attempts on the job's timeline (`_timeline`): an
    attempt that restored a step after the one that committed it, whatever their wall clocks say."""
    mine = list(ledgers)
    order = {a.ledger.attempt: k for k, a in enumerate(_timeline([_gather(l) for l in mine]))}
    return sorted(mine, key=lambda l: order[l.attempt])


def _resume_point(a: _Attempt, committed: Sequence[int]) -> float:
    """The step an attempt resumed from: its restore record, else the newest commit before its first step.

    -inf means it started from scratch (everything before is thrown away); +inf means it threw nothing away.
    """
    had_restore, step = a.restored
    if had_restore:
        return -_INF if step is None else step
    first = a.first_step
    if first is None:
        return _INF
    earlier = [c for c in committed if c < first[1]]
    return max(earlier) if earlier else -_INF


def failure_class(before: Sequence[_Attempt], after: _Attempt) -> str | None:
    """The class of the failure that ended the last of `before`, told by the restore of `after`, the next attempt.

    "local": restored from the local tier or a peer's replica of it (the local tier survived). "node": restored from
    the durable tier while, before the failure, the ledgers show a step newer than the restored one committed, or one
    at least as new committed to the local tier; that newer local copy was lost (node loss, or local files damaged).
    None (unknown): no restore record, a fresh start, no tier (one tier), or a durable restore without that evidence.
    """
    had_restore, step = after.restored
    if not had_restore or step is None:
        return None
    if after.restored_tier in LOCAL_TIERS:
        return "local"
    if after.restored_tier == "durable" and any(
        s > step or (s == step and tier in LOCAL_TIERS) for a in before for s, _, tier in a.commits
    ):
        return "node"
    return None


def _sweep(a: _Attempt, end: int, lost_after: float) -> tuple[list[tuple[int, int, str]], int]:
    """Label every microsecond of [start, end): the latest-begun covering interval wins; gaps are startup/other."""
    first = a.first_step
    first_b = first[0] if first else _INF
    items = []
    lost_steps = 0
    for b, e, o, cat, step in a.intervals:
        if cat == "step":  # thrown away by a later attempt's resume, or by a restore of this one after it ended
            lost = step > lost_after or any(t >= e and (s is None or step > s) for t, s in a.rollbacks)
            lost_steps += lost
            cat = "lost" if lost else "productive"
        elif step is not None:  # a part of a save: labelled apart here, folded into checkpoint_save by attribute()
            cat = _PART_LABEL + step
        b, e = max(b, a.start), min(e, end)
        if e > b:
            items.append((b, e, o, cat))
    items.sort()
    points = sorted({a.start, end, *(x for it in items for x in it[:2])})
    heap: list[tuple[int, int, str]] = []
    out: list[tuple[int, int, str]] = []
    i = 0
    for x, nxt in zip(points, points[1:]):
        while i < len(items) and items[i][0] <= x:
            b, e, o, cat = items[i]
            heapq.heappush(heap, (-o, e, cat))
            i += 1
        while heap and heap[0][1] <= x:
            heapq.heappop(heap)
        if heap:
            label = heap[0][2]
        else:
            label = "startup" if x < first_b else "other"
        if out and out[-1][2] == label and out[-1][1] == x:
            out[-1] = (out[-1][0], nxt, label)
        else:
            out.append((x, nxt, label))
    return out, lost_steps


def _labelled(
    a: _Attempt, k: int, end: int, lost_after: float
) -> tuple[dict[str, int], dict[str, int], list[Segment], int]:
    """Attempt `a`, the k-th on the timeline, swept up to `end` (`_sweep`): its microseconds per category, its
    checkpoint_save split (SAVE_SPLIT), its segments and its lost steps. Kept on `a` for the next call with the same
    placement: a `RootFollower` keeps an ended attempt, whose placement does not change, from call to call."""
    if a.swept is not None and a.swept[0] == (k, end, lost_after):
        return a.swept[1]
    labelled, lost_steps = _sweep(a, end, lost_after)
    micros: dict[str, int] = {}
    split = dict.fromkeys(SAVE_SPLIT, 0)
    segments: list[Segment] = []
    for b, e, cat in labelled:
        if cat == "checkpoint_save":
            split["stall"] += e - b
        elif cat.startswith(_PART_LABEL):
            split[cat[len(_PART_LABEL) :]] += e - b
            cat = "checkpoint_save"
        micros[cat] = micros.get(cat, 0) + e - b
        if segments and segments[-1].category == cat and segments[-1].end_us == b:
            segments[-1] = Segment(segments[-1].begin_us, e, cat, k)  # a part next to its save: one segment
        else:
            segments.append(Segment(b, e, cat, k))
    a.swept = ((k, end, lost_after), (micros, split, segments, lost_steps))
    return a.swept[1]


def attribute(
    ledgers: Iterable[Ledger],
    committed: Iterable[int] = (),
    *,
    rank: int | None = None,
    window_s: float = 3600.0,
) -> Attribution:
    """Attribute a job's wall time from its attempts' ledgers (one rank: `rank`, default the lowest).

    Committed steps are the ledgers' `commit` records, plus `committed` from a caller that knows more (e.g. the
    steps `ckpt.layout.committed_steps` lists); ettr itself knows nothing of a checkpointer's files. A step of attempt k is `lost` if a later attempt resumed from an earlier step; the time after an attempt's
    last record until the next attempt starts is `downtime`. Pure: same inputs, same answer.
    """
    window_s = check_window("window_s", window_s)
    ledgers = list(ledgers)
    if not ledgers:
        raise ValueError("no ledgers to attribute (is ROOT/ettr/ empty?)")
    rank = min(l.rank for l in ledgers) if rank is None else rank
    return _attribute([_gather(l) for l in ledgers if l.rank == rank], rank, committed, window_s, _Passes())


class _Passes:
    """The replay comparisons of a job's first attempts, kept for the next call (a `RootFollower`'s): each attempt
    with its resume point and `Replay`, and the passes of its steps (`FirstPasses`)."""

    def __init__(self) -> None:
        self.done: list[tuple[_Attempt, float, Replay]] = []
        self.passes = FirstPasses()

    def clear(self) -> None:
        """Keep nothing: the next call compares every attempt again."""
        self.__init__()


def _replays(attempts: list[_Attempt], resume: list[float], kept: _Passes) -> list[Replay]:
    """Each attempt's replay: its steps compared with the latest pass of each before it (`compare`). The first
    attempts' are `kept`'s when they are the same attempts with the same resume points (else every attempt is
    compared again); the last attempt's passes are not added: no attempt after it needs them."""
    if len(kept.done) >= len(attempts) or any(
        a is not b or r != s for (a, r, _), b, s in zip(kept.done, attempts, resume)
    ):
        kept.clear()
    out = [replay for *_, replay in kept.done]
    try:
        for k in range(len(kept.done), len(attempts)):
            a = attempts[k]
            out.append(
                compare(kept.passes.after(resume[k]), a.ledger.attempt, a.digests.items(), root_of(a.ledger.source))
            )
            if k + 1 < len(attempts):
                kept.passes.add(a.ledger.attempt, a.digests)
                kept.done.append((a, resume[k], out[-1]))
    except BaseException:  # passes half added are kept for no call
        kept.clear()
        raise
    return out


def _attribute(
    gathered: list[_Attempt], rank: int, committed: Iterable[int], window_s: float, kept: _Passes
) -> Attribution:
    """`attribute` of rank `rank`'s ledgers, gathered (`kept`: as `_replays` takes it)."""
    attempts = _timeline(gathered)
    if not attempts:
        raise ValueError(f"no ledger for rank {rank}")
    commits = [c for a in attempts for c in a.commits]
    committed = set(committed)
    all_committed = tuple(sorted({*committed, *(s for s, _, _ in commits)}))
    held: dict[int, set[str | None]] = {}  # step -> the tiers holding it (None: the only one)
    for a in attempts:  # in the order they ran: a step committed again after its delete is retained
        for kind, s, tier in a.events:
            (held.setdefault(s, set()).add if kind == "commit" else held.setdefault(s, set()).discard)(tier)
    deleted = {s for s, tiers in held.items() if not tiers} - committed  # committed=: the caller saw it in the root
    resume = [_resume_point(a, all_committed) for a in attempts]
    totals = {c: 0 for c in CATEGORIES}
    segments: list[Segment] = []
    summaries = []
    replays = _replays(attempts, resume, kept)
    for k, a in enumerate(attempts):
        end = min(a.last, attempts[k + 1].start) if k + 1 < len(attempts) else a.last
        micros, split, own, lost_steps = _labelled(a, k, end, min(resume[k + 1 :], default=_INF))
        segments += own
        if k + 1 < len(attempts) and attempts[k + 1].start > end:
            segments.append(Segment(end, attempts[k + 1].start, "downtime", DOWNTIME))
            totals["downtime"] += attempts[k + 1].start - end
        for cat, us in micros.items():
            totals[cat] = totals.get(cat, 0) + us
        last = k + 1 == len(attempts)
        status = a.status or ("running" if last else "failed")
        failed = status in ("failed", "error") and not last
        summaries.append(
            AttemptSummary(
                a.ledger.attempt,
                a.ledger.rank,
                a.ledger.source,
                a.start,
                end,
                status,
                a.restored[1] if a.restored[0] else None,
                *a.step_range,
                lost_steps,
                dict(micros),
                a.ledger.torn,
                a.restored_tier,
                sum(a.restore_us),
                failure_class(attempts[: k + 1], attempts[k + 1]) if failed else None,
                dict(split),
                len(a.save_us),
                sum(bg for _, bg, _ in a.commits),
                replays[k],
            )
        )
    return Attribution(
        start_us=attempts[0].start,
        end_us=summaries[-1].end_us,
        micros=totals,
        attempts=tuple(summaries),
        segments=tuple(segments),
        background_us=sum(bg for _, bg, _ in commits),
        committed_steps=all_committed,
        deleted_steps=tuple(s for s in all_committed if s in deleted),
        save_us=tuple(x for a in attempts for x in a.save_us),
        restore_us=tuple(x for a in attempts for x in a.restore_us),
        window_s=window_s,
        newest_commit=max(((s, t) for a in attempts for s, t in a.commit_times.items()), default=None),
    )


def attribute_root(
    root: str,
    *,
    rank: int | None = None,
    window_s: float = 3600.0,
    storage_options: dict[str, Any] | None = None,
    committed: Iterable[int] = (),
) -> Attribution:
    """Attribute from the ledgers under ROOT/ettr/ (and `committed`, as in `attribute`)."""
    rank, ledgers = _rank_ledgers(root, rank, storage_options)
    return attribute(ledgers, committed, rank=rank, window_s=window_s)


def _rank_ledgers(
    root: str,
    rank: int | None,
    storage_options: dict[str, Any] | None,
    known: dict[tuple[str, int], Ledger] | None = None,
) -> tuple[int, list[Ledger]]:
    """The rank to attribute (`rank`, default the lowest) and its ledgers under ROOT/ettr/ (`known` as
    `read_ledgers` takes it)."""
    ranks = ledger_ranks(root, storage_options)  # a LIST; then only the chosen rank's ledgers are read
    if not ranks:
        raise no_ledgers(root)
    if rank is not None and rank not in ranks:
        raise LedgerError(
            f"no ledger of rank {rank} in {ledger_dir(root)}: it holds ledgers of rank {', '.join(map(str, ranks))}"
        )
    rank = min(ranks) if rank is None else rank
    ledgers = read_ledgers(root, storage_options, rank=rank, known=known)
    if not ledgers:  # each one empty (left out, with a warning): "no ledgers to attribute (is ROOT/ettr/ empty?)"
        others = ", ".join(str(r) for r in ranks if r != rank)
        raise LedgerError(
            f"no ledger of rank {rank} in {ledger_dir(root)} holds a record: each one is empty (its attempt ended "
            "before writing its start record)"
            + (f"; it holds ledgers of rank {others} too (--rank R)" if others else "")
        )
    return rank, ledgers


class RootFollower:
    """`attribute_root(root)` again and again while the job goes on (an advisor, after each save), the same answer
    for less: the ledger of an attempt that has ended (an end record, or a later attempt after it: it writes no
    more) is read, gathered, swept and compared once and kept (about 800 bytes per step), and only the others are
    read again. A call costs what the live attempt's ledger costs, not what the whole job's does."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root, self.storage_options = root, storage_options
        self._ended: dict[tuple[str, int], _Attempt] = {}  # (attempt, rank) -> its ledger, gathered
        self._passes = _Passes()

    def attribute(self) -> Attribution:
        """The job's attribution now, of its lowest rank (`attribute_root` with its defaults)."""
        known = {key: a.ledger for key, a in self._ended.items()}
        rank, ledgers = _rank_ledgers(self.root, None, self.storage_options, known)
        gathered = {(l.attempt, l.rank): self._ended.get((l.attempt, l.rank)) or _gather(l) for l in ledgers}
        out = _attribute(list(gathered.values()), rank, (), 3600.0, self._passes)
        self._ended = {(a.attempt, a.rank): gathered[a.attempt, a.rank] for a in out.attempts if a.status != "running"}
        return out
