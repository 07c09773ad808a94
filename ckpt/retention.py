"""Which committed steps to keep: keep-last, keep-every, keep-best; the newest is never deleted."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Retention:
    """A retention policy; with no rule set, every checkpoint is kept."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ValueError("keep_best needs best_metric (the metadata key to rank checkpoints by)")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    def to_delete(self, steps: list[int], metadata: Mapping[int, Mapping[str, Any]]) -> list[int]:
        """The committed steps this policy lets go; never the newest one."""
        if not self.active or not steps:
            return []
        steps = sorted(steps)
        keep = {steps[-1]}
        if self.keep_last:
            keep.update(steps[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best:
            sign = 1 if self.best_mode == "min" else -1

            def score(s: int) -> float:
                v = metadata.get(s, {}).get(self.best_metric)
                return sign * float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.inf

            ranked = sorted((s for s in steps if score(s) != math.inf), key=lambda s: (score(s), -s))
            keep.update(ranked[:self.keep_best])
        return [s for s in steps if s not in keep]
