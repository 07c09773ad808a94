"""When to save: small `SaveDecision` policies a training loop asks after each step, shared by every integration.

The time is passed in (`now`: seconds on one monotonic clock, e.g. ``time.monotonic()``), so a decision never reads
a clock itself and is exact on a fake one. ckpt knows nothing of goodput: an advised interval comes from a callable
the integration wires to its advisor (e.g. `ettr.advise`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol, runtime_checkable

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@runtime_checkable
class SaveDecision(Protocol):
    """Asked after every step whether to checkpoint it; told of every checkpoint (saved, or restored at the start)."""

    def should_save(self, step: int, now: float) -> bool:
        """Whether step `step` (just completed at time `now`) should be checkpointed."""
        ...

    def saved(self, step: int, now: float) -> None:
        """A checkpoint of `step` exists as of `now` (saved, or restored when training starts): intervals restart."""
        ...


class EveryNSteps:
    """Save once `steps` steps have passed since the last checkpoint (or since step 0)."""

    def __init__(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"every_steps must be a positive int, got {steps!r}")
        self.steps = steps
        self._last = 0

    def should_save(self, step: int, now: float) -> bool:
        return step - self._last >= self.steps

    def saved(self, step: int, now: float) -> None:
        self._last = step

    def __repr__(self) -> str:
        return f"EveryNSteps({self.steps})"


class EveryNSeconds:
    """Save once `seconds` have passed since the last checkpoint (before any: since the first question)."""

    def __init__(self, seconds: float) -> None:
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if not (number and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"every_seconds must be a positive number of seconds, got {seconds!r}")
        self.seconds = float(seconds)
        self._since: float | None = None

    def should_save(self, step: int, now: float) -> bool:
        if self._since is None:
            self._since = now
        return now - self._since >= self.seconds

    def saved(self, step: int, now: float) -> None:
        self._since = now

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds:g})"


class AnyOf:
    """Save when any of `decisions` says so: ``AnyOf(EveryNSteps(500), EveryNSeconds(1800))``; all hear of a save."""

    def __init__(self, *decisions: SaveDecision) -> None:
        bad = [d for d in decisions if not isinstance(d, SaveDecision)]
        if not decisions or bad:
            raise TypeError(f"AnyOf takes one or more SaveDecisions (should_save and saved), got {decisions!r}")
        self.decisions = decisions

    def should_save(self, step: int, now: float) -> bool:
        answers = [d.should_save(step, now) for d in self.decisions]  # every one asked: each starts its own clock
        return any(answers)

    def saved(self, step: int, now: float) -> None:
        for d in self.decisions:
            d.saved(step, now)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.decisions))})"


@dataclass(frozen=True)
class Retune:
    """How an advised schedule follows its advisor: bounded by the user, and damped so that it cannot oscillate.

    Each advice moves the interval `damping` of the way from the one in force (0 < damping <= 1: a steady advice is
    approached monotonically, never overshot); advice within `deadband` (a fraction of the interval in force) changes
    nothing; the result stays within [`min_s`, `max_s`]. K (every K-th save persisted) moves toward its advice the
    same way, by at least one, within [1, `max_persist_every`]. ``Retune(damping=1, deadband=0)`` follows the advice.
    """

    min_s: float = 0.0
    max_s: float = math.inf
    damping: float = 0.5
    deadband: float = 0.1
    max_persist_every: int = 64

    def __post_init__(self) -> None:
        if not (0 <= self.min_s <= self.max_s and math.isfinite(self.min_s)):
            raise ValueError(
                f"Retune needs a finite min_s >= 0 and max_s >= min_s, got min_s={self.min_s!r}, max_s={self.max_s!r}"
            )
        if not 0 < self.damping <= 1:
            raise ValueError(f"Retune.damping must be in (0, 1], got {self.damping!r}")
        if not 0 <= self.deadband < 1:
            raise ValueError(f"Retune.deadband must be in [0, 1), got {self.deadband!r}")
        if (
            isinstance(self.max_persist_every, bool)
            or not isinstance(self.max_persist_every, int)
            or self.max_persist_every < 1
        ):
            raise ValueError(f"Retune.max_persist_every must be a positive int, got {self.max_persist_every!r}")

    def interval(self, current: float | None, advised: float) -> float:
        """The interval to use after `advised` when `current` is in force (None: none in seconds yet, taken as is)."""
        if current is not None:
            if abs(advised - current) <= self.deadband * current:
                return current
            advised = current + self.damping * (advised - current)
        return min(max(advised, self.min_s), self.max_s)

    def persist_every(self, current: int, advised: int) -> int:
        """The K to use after `advised` when `current` is in force."""
        advised = min(max(int(advised), 1), self.max_persist_every)
        move = math.ceil(self.damping * abs(advised - current))
        return current + move if advised > current else current - move


class AdvisedInterval:
    """`start` until an advisor has a number; then every that many seconds, asked again after each checkpoint.

    `interval_s` returns the advised interval in seconds, or None while it cannot advise yet (e.g. no save measured);
    a non-positive or non-finite answer is ignored. `retune` bounds and damps how the interval follows the advice
    (from a `start` of seconds too). ``current`` is the decision in force.
    """

    def __init__(
        self, interval_s: Callable[[], float | None], start: SaveDecision, retune: Retune | None = None
    ) -> None:
        self.interval_s = interval_s
        self.current: SaveDecision = start
        self.retune = retune if retune is not None else Retune()

    @property
    def seconds(self) -> float | None:
        """The interval in force, in seconds (None while `start` is not one)."""
        return self.current.seconds if isinstance(self.current, EveryNSeconds) else None

    def should_save(self, step: int, now: float) -> bool:
        return self.current.should_save(step, now)

    def saved(self, step: int, now: float) -> None:
        self.current.saved(step, now)
        self._follow(step, now, self.interval_s())

    def _follow(self, step: int, now: float, advised: float | None) -> None:
        """Move the interval toward `advised` (ignored: None, non-positive, non-finite), as `retune` allows."""
        if advised is not None and math.isfinite(advised) and advised > 0:
            seconds = self.retune.interval(self.seconds, advised)
            if seconds != self.seconds and seconds > 0:
                self.current = EveryNSeconds(seconds)
                self.current.saved(step, now)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(current={self.current!r})"


class AdvisedTiers(AdvisedInterval):
    """`AdvisedInterval` for two tiers: the advisor gives the pair (local interval in seconds, K), refitted after each
    checkpoint; the interval and `persist_every` (every K-th save persisted to the durable root) follow it as
    `retune` allows. The loop hands `persist_every` to the manager (`CheckpointManager.persist_every`)."""

    def __init__(
        self,
        advice: Callable[[], tuple[float, int] | None],
        start: SaveDecision,
        persist_every: int,
        retune: Retune | None = None,
    ) -> None:
        super().__init__(lambda: None, start, retune)
        self.advice, self.persist_every = advice, persist_every

    def saved(self, step: int, now: float) -> None:
        self.current.saved(step, now)
        pair = self.advice()
        if pair is not None:
            self._follow(step, now, pair[0])
            self.persist_every = self.retune.persist_every(self.persist_every, pair[1])

    def __repr__(self) -> str:
        return f"AdvisedTiers(current={self.current!r}, persist_every={self.persist_every})"


class Preemption:
    """Save at the next step once a preemption signal arrived; its handler only sets a flag.

    ``with Preemption() as preempt:`` installs the handlers (SIGTERM and SIGUSR1 by default) and puts the previous
    ones back on exit. `signum` is the signal received (None before); it stays set after the save, so the loop can
    stop, and this decision asks for one save per signal.
    """

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS) -> None:
        if not isinstance(signals, Iterable) or isinstance(signals, str):  # one signal failed "not iterable"
            raise TypeError(f"signals must be a list of signals, e.g. [signal.SIGTERM], got {signals!r}")
        self.signals = tuple(signals)
        for signum in self.signals:  # checked here, not when the handlers are installed
            valid = type(signum) is int or isinstance(signum, signal.Signals)
            if not valid or signum not in signal.valid_signals() or signum in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"signals: {signum!r} is not a signal a handler can catch (e.g. signal.SIGTERM)")
        self.signum: int | None = None
        self._pending = False
        self._previous: dict[int, Any] = {}

    def install(self) -> Preemption:
        """Install the handlers (main thread only, as for any Python signal handler)."""
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self.handle)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: remember the signal; the save happens at the next step boundary."""
        self.signum, self._pending = signum, True

    @property
    def requested(self) -> bool:
        """True once a preemption signal arrived."""
        return self.signum is not None

    def should_save(self, step: int, now: float) -> bool:
        return self._pending

    def saved(self, step: int, now: float) -> None:
        self._pending = False
