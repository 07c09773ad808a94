"""Per-rank step times, the step-time deviation and the slowest rank per window of steps: a pure function of the
ledgers of every rank (docs/goodput.md, stragglers)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .attribution import placed
from .ledger import Ledger, no_ledgers, read_ledgers

# The span category a training loop puts around its blocking collective (`tracker.span("collective_wait")`): the time a
# rank waits there for the others is no time of its own, so a rank's busy time is its steps less these spans.
WAIT = "collective_wait"
WINDOW_STEPS = 100  # the slowest rank is named per window of this many steps (by step number)
# The step-time deviation of ml-goodput-measurement: p90 of the last 100 |step time - ideal| minus the median of the
# 1,000 before them
RECENT, BASELINE, PERCENTILE = 100, 1000, 90.0


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values of an even count); `values` not empty."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def percentile(values: Sequence[float], p: float) -> float:
    """The `p`-th percentile, linearly interpolated between the two nearest ranks (numpy's default); not empty."""
    ordered = sorted(values)
    index = (len(ordered) - 1) * p / 100
    low = int(index)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (index - low)


def ideal_step(times: Sequence[float]) -> float | None:
    """The ideal step time: the mean of the step times at most median + 3 MAD (median absolute deviation, unscaled);
    None without steps."""
    if not times:
        return None
    mid = median(times)
    mad = median([abs(t - mid) for t in times])
    normal = [t for t in times if t <= mid + 3 * mad]
    return sum(normal) / len(normal)


def step_deviation(times: Sequence[float], ideal: float) -> float | None:
    """The step-time deviation of `times` (in step order) from `ideal`, on each step's |time - ideal|: the p90 of the
    last 100 minus the median of the 1,000 before them; with 100 to 1,099 steps, the p90 of the last 100 alone; with
    fewer than 100, their mean (as ml-goodput-measurement does); None without steps."""
    deviations = [abs(t - ideal) for t in times]
    if not deviations:
        return None
    if len(deviations) < RECENT:
        return sum(deviations) / len(deviations)
    spike = percentile(deviations[-RECENT:], PERCENTILE)
    if len(deviations) < RECENT + BASELINE:
        return spike
    return spike - median(deviations[-RECENT - BASELINE : -RECENT])


@dataclass(frozen=True)
class RankSteps:
    """One rank's steps: each step's last run (a step re-run after a restart counts once), in microseconds."""

    rank: int
    steps: int
    step_us: int  # its steps' durations together (end - begin of each step record)
    wait_us: int  # the collective_wait spans inside them
    ideal_step_us: float | None  # `ideal_step` of its step durations
    deviation_us: float | None  # `step_deviation` of its step durations, in step order

    @property
    def busy_us(self) -> int:
        """Its steps less its waits for the other ranks: the time the rank itself needed."""
        return self.step_us - self.wait_us


@dataclass(frozen=True)
class StepWindow:
    """The slowest rank in one window of steps (`first_step` to `last_step`, those every rank ran)."""

    first_step: int
    last_step: int
    steps: int  # steps of the window that every rank ran: the ones compared
    slowest_rank: int  # the rank with the most busy time in them (ties: the lowest rank)
    slowest_busy_us: int
    others_busy_us: float  # the median of the other ranks' busy time in them

    @property
    def waited_us(self) -> float:
        """The time a typical other rank waited for the slowest one in this window: its busy time less theirs."""
        return self.slowest_busy_us - self.others_busy_us


@dataclass(frozen=True)
class Stragglers:
    """Per-rank step times and the slowest rank per window of `window` steps (window k: steps k*window to
    k*window + window - 1)."""

    window: int
    ranks: tuple[RankSteps, ...]
    windows: tuple[StepWindow, ...]  # none with fewer than two ranks

    @property
    def waited_us(self) -> float:
        """The job's time spent waiting for the slowest rank, window by window."""
        return sum(w.waited_us for w in self.windows)

    def waited_per_rank_us(self) -> dict[int, float]:
        """Rank -> the waiting for it, over the windows where it was the slowest."""
        out: dict[int, float] = {}
        for w in self.windows:
            out[w.slowest_rank] = out.get(w.slowest_rank, 0) + w.waited_us
        return out

    @property
    def slowest_rank(self) -> int | None:
        """The rank the job waited for most (ties: the lowest); None without windows."""
        waited = self.waited_per_rank_us()
        return max(sorted(waited), key=waited.__getitem__) if waited else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in seconds."""
        return {
            "window_steps": self.window,
            "slowest_rank": self.slowest_rank,
            "waited_seconds": self.waited_us / 1e6,
            "waited_seconds_per_rank": {str(r): us / 1e6 for r, us in sorted(self.waited_per_rank_us().items())},
            "ranks": [
                {
                    "rank": r.rank,
                    "steps": r.steps,
                    "step_seconds": r.step_us / 1e6,
                    "busy_seconds": r.busy_us / 1e6,
                    "collective_wait_seconds": r.wait_us / 1e6,
                    "ideal_step_seconds": _seconds(r.ideal_step_us),
                    "step_time_deviation_seconds": _seconds(r.deviation_us),
                }
                for r in self.ranks
            ],
            "windows": [
                {
                    "first_step": w.first_step,
                    "last_step": w.last_step,
                    "steps": w.steps,
                    "slowest_rank": w.slowest_rank,
                    "slowest_busy_seconds": w.slowest_busy_us / 1e6,
                    "others_busy_seconds": w.others_busy_us / 1e6,
                    "waited_seconds": w.waited_us / 1e6,
                }
                for w in self.windows
            ],
        }


def _seconds(us: float | None) -> float | None:
    return None if us is None else us / 1e6


def _steps_of(ledgers: Iterable[Ledger]) -> dict[int, tuple[int, int]]:
    """Step -> (duration, collective waits inside it) of one rank, each step's last run: the ledgers in the order
    attribution places their attempts (`placed`: by when they began recording, and an attempt that restored a step
    after the one that committed it, even where its wall clock went back), a later run of a step replacing an
    earlier one. Steps still open at a kill are no step."""
    out: dict[int, tuple[int, int]] = {}
    for ledger in placed(ledgers):
        steps = sorted((r["b"], r["e"], r["s"]) for r in ledger.records if r["k"] == "step")
        begins = [b for b, _, _ in steps]
        waits: dict[int, int] = {}
        for r in ledger.records:
            if r["k"] == "span" and r["c"] == WAIT:
                i = bisect.bisect_right(begins, r["b"]) - 1
                if i >= 0 and r["e"] <= steps[i][1]:  # inside that step (a wait between steps is no step's)
                    waits[i] = waits.get(i, 0) + r["e"] - r["b"]
        for i, (b, e, s) in enumerate(steps):
            out[s] = (e - b, min(waits.get(i, 0), e - b))
    return out


def stragglers(ledgers: Iterable[Ledger], *, window: int = WINDOW_STEPS) -> Stragglers:
    """Per-rank step times, ideal step time and deviation, and the slowest rank per window, from every rank's ledgers.

    A rank's busy time is its step time less its `collective_wait` spans. In each window the ranks are compared on
    the steps every rank ran (a rank that ran none, e.g. one that died at startup, is left out); the slowest has the most busy time, and the time waited for it is its busy time less
    the median of the others'. Pure: same ledgers, same answer.
    """
    if window < 1:
        raise ValueError(f"window must be a positive number of steps, got {window!r}")
    by_rank: dict[int, list[Ledger]] = {}
    for ledger in ledgers:
        by_rank.setdefault(ledger.rank, []).append(ledger)
    steps = {rank: _steps_of(ls) for rank, ls in sorted(by_rank.items())}
    ranks = []
    for rank, mine in steps.items():
        times = [mine[s][0] for s in sorted(mine)]
        ideal = ideal_step(times)
        ranks.append(
            RankSteps(
                rank,
                len(mine),
                sum(times),
                sum(w for _, w in mine.values()),
                ideal,
                None if ideal is None else step_deviation(times, ideal),
            )
        )
    running = {rank: mine for rank, mine in steps.items() if mine}  # a rank that ran no step is not compared
    return Stragglers(window, tuple(ranks), _windows(running, window) if len(running) > 1 else ())


def _windows(steps: dict[int, dict[int, tuple[int, int]]], window: int) -> tuple[StepWindow, ...]:
    """The slowest rank of each window, over the steps every rank that ran steps ran."""
    common = sorted(set.intersection(*(set(mine) for mine in steps.values())))
    grouped: dict[int, list[int]] = {}
    for s in common:
        grouped.setdefault(s // window, []).append(s)
    out = []
    for k, members in sorted(grouped.items()):
        busy = {rank: sum(mine[s][0] - mine[s][1] for s in members) for rank, mine in steps.items()}
        slowest = max(sorted(busy), key=busy.__getitem__)
        others = [us for rank, us in busy.items() if rank != slowest]
        out.append(
            StepWindow(k * window, k * window + window - 1, len(members), slowest, busy[slowest], median(others))
        )
    return tuple(out)


def stragglers_root(
    root: str, *, window: int = WINDOW_STEPS, storage_options: dict[str, Any] | None = None
) -> Stragglers:
    """`stragglers` of the ledgers under ROOT/ettr/, every rank's (one GET per segment of each)."""
    ledgers = read_ledgers(root, storage_options)
    if not ledgers:
        raise no_ledgers(root)
    return stragglers(ledgers, window=window)


class WindowMeter:
    """One rank's busy and collective-wait microseconds per window of steps, counted live on the tracker's step path
    (the same windows and busy time as `stragglers`, for this rank and attempt alone)."""

    __slots__ = ("window", "_index", "_steps", "_busy", "_wait", "_pending")

    def __init__(self, window: int = WINDOW_STEPS) -> None:
        if window < 1:
            raise ValueError(f"straggler_window must be a positive number of steps, got {window!r}")
        self.window = window
        self._index: int | None = None
        self._steps = self._busy = self._wait = self._pending = 0

    def waited(self, us: int) -> None:
        """A collective_wait span of `us` microseconds closed inside the open step."""
        self._pending += us

    def step(self, step: int, us: int) -> tuple[int, int, int, int] | None:
        """Count step `step` of `us` microseconds (its waits told by `waited`). Returns the window the step leaves,
        (first step, steps, busy us, wait us), when it is the first step of another window; else None."""
        done = None
        if step // self.window != self._index:
            done = self.close()
            self._index = step // self.window
        wait = self._pending
        if wait:  # the step path: no call when the step had no wait
            self._pending = 0
            wait = us if wait > us else wait
            self._wait += wait
        self._busy += us - wait
        self._steps += 1
        return done

    def close(self) -> tuple[int, int, int, int] | None:
        """The window in progress, as `step` returns it, at the end of the attempt (None without steps)."""
        done = (self._index * self.window, self._steps, self._busy, self._wait) if self._steps else None
        self._index, self._steps, self._busy, self._wait = None, 0, 0, 0
        return done
