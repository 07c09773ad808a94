"""Which committed steps to keep: small retention policies, combined with `Keep`.

A policy only names the steps it keeps; the manager deletes the rest, and never the newest committed step nor the
step it has just committed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

Metadata = Mapping[int, Mapping[str, Any]]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps survive a save (as Orbax's preservation policies do)."""

    def keep(self, steps: Sequence[int], metadata: Metadata) -> set[int]:
        """The steps of `steps` (committed, ascending) to keep; `metadata[s]` is step s's save metadata."""
        ...


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KeepLast:
    """The newest `n` steps."""

    n: int

    def __post_init__(self) -> None:
        _positive("keep_last", self.n)

    def keep(self, steps: Sequence[int], metadata: Metadata) -> set[int]:
        return set(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Every step that is a multiple of `n` (milestones kept for good)."""

    n: int

    def __post_init__(self) -> None:
        _positive("keep_every", self.n)

    def keep(self, steps: Sequence[int], metadata: Metadata) -> set[int]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True)
class KeepBest:
    """The `n` steps with the lowest (mode "min") or highest ("max") finite `metric` in their metadata; on a tie the
    newer step. Steps without a finite number (int or float, not bool) for the metric are never among the best."""

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive("keep_best", self.n)
        if not self.metric:
            raise ValueError("keep_best needs best_metric (the metadata key to rank checkpoints by)")
        if not isinstance(self.metric, str):
            raise TypeError(f"best_metric must be the metadata key (a str) to rank checkpoints by, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[int], metadata: Metadata) -> set[int]:
        sign = 1 if self.mode == "min" else -1

        def score(s: int) -> float:
            v = metadata.get(s, {}).get(self.metric)
            try:  # an int past a float's range (10**400) is no finite value either
                number = isinstance(v, (int, float)) and not isinstance(v, bool)  # {"loss": False} is no loss of 0
                return sign * float(v) if number and math.isfinite(v) else math.inf
            except OverflowError:
                return math.inf

        ranked = sorted((s for s in steps if score(s) != math.inf), key=lambda s: (score(s), -s))
        return set(ranked[: self.n])


class Keep:
    """Keeps every step that any of `policies` keeps: ``Keep(KeepLast(3), KeepBest(2, "loss"))``."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:  # built from an empty list of settings, it kept nothing: every step but the newest went
            raise ValueError("Keep needs at least one policy (Keep() would keep only the newest step)")
        bad = [p for p in policies if not isinstance(p, RetentionPolicy)]
        if bad:
            raise TypeError(f"Keep takes retention policies (with a keep(steps, metadata) method), got {bad!r}")
        self.policies = policies

    def keep(self, steps: Sequence[int], metadata: Metadata) -> set[int]:
        return set().union(*(p.keep(steps, metadata) for p in self.policies))

    def __repr__(self) -> str:
        return f"Keep({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keep) and self.policies == other.policies


def policy_of(
    retention: RetentionPolicy | None = None,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
) -> RetentionPolicy | None:
    """`CheckpointManager`'s retention from its keywords, checked: `retention`, or the policy the shorthands stand
    for; None (keep everything) when none is set."""
    if keep_best is None and best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    policies: list[RetentionPolicy] = []
    if keep_last is not None:
        policies.append(KeepLast(keep_last))
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    if keep_best is not None:
        policies.append(KeepBest(keep_best, best_metric or "", best_mode))
    if retention is not None and policies:
        raise ValueError("give retention= or the keep_last/keep_every/keep_best shorthands, not both")
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise TypeError(f"retention must be a RetentionPolicy (a keep(steps, metadata) method), got {retention!r}")
    if retention is not None or not policies:
        return retention
    return policies[0] if len(policies) == 1 else Keep(*policies)


class StepMetadata(Mapping[int, Mapping[str, Any]]):
    """The save metadata of `steps`, each read by `read(step)` on first access and cached in `cache`, so a policy
    that never looks (KeepLast) costs no manifest read."""

    def __init__(
        self, steps: Sequence[int], read: Callable[[int], Mapping[str, Any]], cache: dict[int, Mapping[str, Any]]
    ) -> None:
        self._steps, self._read, self._cache = set(steps), read, cache

    def __getitem__(self, step: int) -> Mapping[str, Any]:
        if step not in self._steps:
            raise KeyError(step)
        if step not in self._cache:
            self._cache[step] = self._read(step)
        return MappingProxyType(self._cache[step])  # read-only: a policy's pop() emptied the cache of later saves

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._steps))

    def __len__(self) -> int:
        return len(self._steps)


def doomed(
    policy: RetentionPolicy, steps: Sequence[int], metadata: Metadata, *, spare: Collection[int] = ()
) -> list[int]:
    """The committed `steps` (ascending) that `policy` does not keep; never the newest, whatever it says, nor a step
    of `spare`: the step just committed, which a save below a newer step (a run resumed with `restore(step=)` from
    before the newest) would otherwise see deleted by its own retention right after its handle said it committed."""
    # the policy gets its own copy: one that sorted it in place (newest first) made steps[:-1] hold the newest
    kept = _kept(policy, list(steps), metadata) if steps else set()
    return [s for s in steps[:-1] if s not in kept and s not in spare]


def _kept(policy: RetentionPolicy, steps: Sequence[int], metadata: Metadata) -> set[int]:
    """`policy`'s answer as a set of steps, checked: a generator tested step by step was used up by the first miss
    (deleting the steps it kept after it), and strings ('100') matched no step (deleting every one)."""
    answer = policy.keep(steps, metadata)
    try:
        kept = set(answer)
    except TypeError:
        raise TypeError(f"{policy!r}.keep(steps, metadata) must return the steps to keep, got {answer!r}") from None
    bad = [s for s in kept if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
    if bad:
        raise TypeError(
            f"{policy!r}.keep(steps, metadata) must return steps (ints) of the steps it is given, got {bad[:3]!r} "
            f"among {len(kept)}: nothing deleted"
        )
    return kept
