"""When to save: small `SaveDecision` policies a training loop asks after each step, shared by every integration.

The time is passed in (`now`: seconds on one monotonic clock, e.g. ``time.monotonic()``), so a decision never reads
a clock itself and is exact on a fake one. ckpt knows nothing of goodput: an advised interval comes from a callable
the integration wires to its advisor (e.g. `ettr.advise`).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Sequence
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


class AdvisedInterval:
    """`start` until an advisor has a number; then every `interval_s()` seconds, asked again after each checkpoint.

    `interval_s` returns the advised interval in seconds, or None while it cannot advise yet (e.g. no save measured);
    a non-positive or non-finite answer is ignored. ``current`` is the decision in force.
    """

    def __init__(self, interval_s: Callable[[], float | None], start: SaveDecision) -> None:
        self.interval_s = interval_s
        self.current: SaveDecision = start

    def should_save(self, step: int, now: float) -> bool:
        return self.current.should_save(step, now)

    def saved(self, step: int, now: float) -> None:
        self.current.saved(step, now)
        advised = self.interval_s()
        if advised is not None and math.isfinite(advised) and advised > 0:
            self.current = EveryNSeconds(advised)
            self.current.saved(step, now)

    def __repr__(self) -> str:
        return f"AdvisedInterval(current={self.current!r})"


class Preemption:
    """Save at the next step once a preemption signal arrived; its handler only sets a flag.

    ``with Preemption() as preempt:`` installs the handlers (SIGTERM and SIGUSR1 by default) and puts the previous
    ones back on exit. `signum` is the signal received (None before); it stays set after the save, so the loop can
    stop, and this decision asks for one save per signal.
    """

    def __init__(self, signals: Sequence[int] = PREEMPTION_SIGNALS) -> None:
        self.signals = tuple(signals)
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
