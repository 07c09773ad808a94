"""What the manager tells a goodput tracker about saves and restores: a protocol ckpt owns, so that ckpt and ettr
never import each other (`ettr.GoodputTracker` happens to satisfy it; the integrations plug one into the other)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol


class CheckpointObserver(Protocol):
    """What the manager tells a goodput tracker (e.g. `ettr.GoodputTracker`); every method must be thread-safe."""

    def span(self, category: str, **attrs: Any) -> ContextManager[Any]: ...
    def checkpoint_committed(
        self, step: int, background_seconds: float, nbytes: int, *, tier: str | None = None
    ) -> None: ...
    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None: ...
    def checkpoint_failed(self, step: int, error: BaseException) -> None: ...

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
