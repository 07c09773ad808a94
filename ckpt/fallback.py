"""Which step a restore takes (policy): the candidates newest first, until one reads intact on every rank.

A step deleted while being read (another process's retention) is no damage: the steps are listed again. A damaged
one is set aside by the target (quarantine), reported as a warning, and the next candidate is tried: the same
step's durable copy first when a local copy was damaged, else the previous step.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

from . import layout
from . import lease as lease_mod
from . import restore as restore_mod
from .distributed import Ranks, leader_reads
from .errors import CheckpointError, CorruptCheckpointError, PartialCopyError, StepNotFoundError, described
from .storage import Storage
from .target import DURABLE, Source, Target

log = logging.getLogger("ckpt")

Read = Callable[[Storage, int], "tuple[restore_mod.ReadPlan | None, Exception | None]"]


@dataclass
class Found:
    """The outcome of a walk: the source read and its verified plan (None: nothing committed), the sources left
    untried, the damage met."""

    source: Source | None = None
    plan: restore_mod.ReadPlan | None = None
    remaining: list[Source] = field(default_factory=list)
    damaged: dict[tuple[int, str], CorruptCheckpointError] = field(default_factory=dict)
    partial: dict[tuple[int, str], PartialCopyError] = field(default_factory=dict)  # copies lacking a needed region

    def tried(self) -> dict[tuple[int, str], CheckpointError]:
        """The sources not to try again: damaged, or lacking a region."""
        return {**self.damaged, **self.partial}


def candidates(
    durable: Storage, target: Target, ranks: Ranks, step: int | None, damaged: dict[tuple[int, str], object]
) -> list[Source]:
    """Where to try, newest first: `step`, or every committed step not found damaged, in its tiers (one list for
    all ranks: rank 0's view of the durable root, and with a local tier every rank's inventory)."""
    steps = leader_reads(ranks, lambda: layout.committed_steps(durable), f"list the steps of {durable.url}")
    sources = [c for c in target.sources(steps) if (c.step, c.tier) not in damaged and step in (None, c.step)]
    return sources if sources or step is None else [Source(step, DURABLE)]


def walk(
    durable: Storage,
    target: Target,
    ranks: Ranks,
    step: int | None,
    read: Read,
    lease: lease_mod.Lease | None,
    failure: Exception | None = None,
    keys: Sequence[str] | None = None,
) -> Found:
    """Try the candidates until one is read intact everywhere (`read` verifies, applies nothing); raises when
    `step` was asked for and is not committed or damaged, or when every committed step is damaged.

    First every rank learns the others' `step`, `keys` and `failure` (this rank cannot restore: an earlier write's
    error): any failure, or steps or keys that differ, raise on every rank (that rank its own error, the others a
    CheckpointError naming it), so none waits for another, reads another step's bytes, or restores entries another
    leaves as they are (an FSDP optimizer with some ranks' shards restored and the others' a step ahead)."""
    chosen = None if keys is None else sorted(keys)
    told = ranks.all_gather_json([step, chosen, None if failure is None else described(failure)])
    if failure is not None:
        raise failure
    failed = [(r, m) for r, (*_, m) in enumerate(told) if m]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} cannot restore: {failed[0][1]}")
    for i, what in enumerate(("steps", "keys")):
        if any(t[i] != told[0][i] for t in told):
            each = ", ".join(f"rank {r}: {t[i]}" for r, t in enumerate(told))
            raise CheckpointError(
                f"the ranks called restore with different {what} ({each}): every rank restores the same"
            )
    found = Found()
    todo, relists = candidates(durable, target, ranks, step, found.tried()), 0
    while todo:
        source = todo.pop(0)
        s, storage = source.step, target.storage_of(source)
        error = target.heal(source)  # a lost local copy back from its peer
        plan, error = read(storage, s) if error is None else (None, error)
        try:
            outcome = restore_mod.agree(storage, ranks, s, error)  # one decision for every rank
        except BaseException:
            if plan is not None:
                plan.undo()
            raise
        if outcome is not None and plan is not None:  # read here, not everywhere: the caller's tensors as they were
            plan.undo()
        if outcome == "vanished":
            if step is not None:
                raise StepNotFoundError(f"step {step} is not committed in {durable.url}")
            relists = restore_mod.relisted(durable.url, relists)
            log.info("step %d vanished while being read (retention?); listing the steps again", s)
            todo = candidates(durable, target, ranks, step, found.tried())
            continue
        if isinstance(outcome, PartialCopyError):  # no damage: nothing set aside; the next copy, if any
            found.partial[(s, source.tier)] = outcome
            if todo and (step is None or todo[0].step == s):
                log.warning("not restoring%s: %s; trying the next copy", target.where(source), outcome)
                continue
            raise outcome
        if isinstance(outcome, CorruptCheckpointError):
            found.damaged[(s, source.tier)] = outcome
            if step is not None and not todo:
                raise outcome
            aside = target.set_aside(source, outcome, error, lease)
            then = "durable copy of the step" if todo and todo[0].step == s else "previous committed step"
            warnings.warn(
                f"checkpoint step {s}{target.where(source)} is damaged: {outcome}; {aside}; falling back to the {then}",
                RuntimeWarning,
                stacklevel=3,  # the caller of CheckpointManager.restore
            )
            continue
        found.source, found.plan, found.remaining = source, plan, todo
        return found
    if found.damaged:
        raise CorruptCheckpointError(
            f"no intact checkpoint in {durable.url}: {len(found.damaged)} damaged "
            f"(newest error: {next(iter(found.damaged.values()))})"
        )
    return found
