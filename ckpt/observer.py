"""What the manager tells a goodput tracker about saves and restores: a protocol ckpt owns, so that ckpt and ettr
never import each other (`ettr.GoodputTracker` happens to satisfy it; the integrations plug one into the other)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol


class CheckpointObserver(Protocol):
    """What the manager tells a goodput tracker (e.g. `ettr.GoodputTracker`); every method must be thread-safe."""

    def span(self, category: str, **attrs: Any) -> ContextManager[Any]:
        """Time the block as `category` (``checkpoint_save``, ``checkpoint_restore``; `attrs`: step, part)."""
        ...

    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int, *, tier: str | None = None
    ) -> None:
        """Step `step` is committed (durable): its background write took `background_seconds` for `nbytes`."""
        ...

    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None:
        """A restore ended: the step it loaded from `tier`, or None (a fresh start)."""
        ...

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        """The save of `step` failed in the background with `error` (nothing was committed)."""
        ...

    # Optional (the manager calls them when the observer has them): `use_run_id(run_id)` when the observer is
    # handed to the manager; `checkpoint_deleted(step[, tier=])` when a committed step is deleted (retention or
    # delete(); `tier` with two tiers, as for commits).


class _NoTracker:
    def span(self, category: str, **attrs: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int, *, tier: str | None = None
    ) -> None:
        pass

    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None:
        pass

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        pass


NO_TRACKER = _NoTracker()


def check_observer(tracker: Any) -> CheckpointObserver | None:
    """`tracker` (None: none) if it has every `CheckpointObserver` method; else a TypeError naming those it lacks."""
    needs = ("span", "checkpoint_committed", "checkpoint_restored", "checkpoint_failed")
    lacks = [name for name in needs if tracker is not None and not callable(getattr(tracker, name, None))]
    if lacks:
        raise TypeError(f"tracker must be a CheckpointObserver (e.g. ettr.GoodputTracker), got {tracker!r}: no {lacks}")
    return tracker


def tell_run_id(observer: CheckpointObserver, run_id: str) -> None:
    """Tell an observer the run's id, if it listens (the optional `use_run_id`: ettr's job id defaults to it)."""
    use_run_id = getattr(observer, "use_run_id", None)
    if use_run_id is not None:
        use_run_id(run_id)


def tell_deleted(observer: CheckpointObserver, step: int, *, tier: str | None) -> None:
    """Tell an observer a committed step was deleted from `tier` (None: the only one), if it listens (the optional
    `checkpoint_deleted`)."""
    deleted = getattr(observer, "checkpoint_deleted", None)
    if deleted is not None:
        deleted(step, **({"tier": tier} if tier else {}))
