"""Replay verification: the steps a resumed attempt trains a second time, compared bit for bit with their first pass.

A step record may carry a digest (docs/goodput.md, the ledger): the loss's exact bits, the batch hash and user
scalars. Pure functions of the ledgers' digests, used by attribution (the report) and by the tracker (live
telemetry) alike.
"""

from __future__ import annotations

import bisect
import shlex
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# The step record's optional digest fields: the loss, the batch hash, user scalars ({name: bits})
LOSS, BATCH, SCALARS = "l", "h", "x"
_DOUBLE = struct.Struct(">d")  # big-endian: the hex digits read as the number's bits, sign first


def float_bits(value: Any) -> str:
    """A number's exact bits: its IEEE-754 binary64 value as 16 hex digits. A float32, bfloat16 or float16 loss (a
    tensor: ``float()`` reads it with ``.item()``) widens to float64 exactly, so equal bits mean the same value."""
    return _DOUBLE.pack(float(value)).hex()


def bits_value(bits: str) -> float:
    """The float 16 hex digits of `float_bits` stand for."""
    return _DOUBLE.unpack(bytes.fromhex(bits))[0]


class Digest(NamedTuple):
    """What a step's ledger record says about its computation: loss bits, batch hash, user scalars' bits. `compare`
    also takes plain (loss, batch, scalars) tuples, which the garbage collector stops tracking: the tracker keeps
    one per step it trains again until its next flush."""

    loss: str | None = None
    batch: str | None = None
    scalars: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Digest | None:
        """The digest of a step record; None when it carries none (a ledger before digests, no loss recorded)."""
        loss, batch, scalars = record.get(LOSS), record.get(BATCH), record.get(SCALARS)
        if loss is None and batch is None and not scalars:
            return None
        return cls(loss, batch, tuple(sorted(scalars.items())) if scalars else ())


@dataclass(frozen=True)
class Divergence:
    """A step whose second pass differs from its first: where, and in which field."""

    step: int
    attempt: str  # the attempt that trained it again
    first_attempt: str  # the attempt whose pass it is compared with
    first: Digest
    again: Digest
    explain: str  # the command that shows the step's batch: python -m ckpt explain ROOT --step N

    def text(self) -> str:
        """``loss 0x3f8a... (0.51) vs 0x3f8b... (0.52), batch equal``: each field both passes recorded."""
        a, b = self.first, self.again
        parts = []
        if a.loss is not None and b.loss is not None:
            parts.append(f"loss {_shown(a.loss)} vs {_shown(b.loss)}" if a.loss != b.loss else "loss equal")
        if a.batch is not None and b.batch is not None:
            parts.append(f"batch {a.batch} vs {b.batch}" if a.batch != b.batch else "batch equal")
        first, again = dict(a.scalars), dict(b.scalars)
        parts += [
            f"{k} {_shown(first[k])} vs {_shown(again[k])}"
            for k in sorted(first.keys() & again.keys())
            if first[k] != again[k]
        ]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "first_attempt": self.first_attempt,
            "first": _digest_dict(self.first),
            "again": _digest_dict(self.again),
            "text": self.text(),
            "explain": self.explain,
        }


def _shown(bits: str) -> str:
    """Bits and the number they stand for: ``0x3ff2000000000000 (1.125)``."""
    return f"0x{bits} ({bits_value(bits)!r})"


def _digest_dict(d: Digest) -> dict[str, Any]:
    return {"loss": d.loss, "batch": d.batch, "scalars": dict(d.scalars)}


Expected = dict[int, tuple[str, "Digest | None"]]  # step -> (attempt, digest) of its first pass


@dataclass(frozen=True)
class Replay:
    """Steps trained a second time after a resume and how their digests compare with the first pass.

    `replayed` counts every such step; `equal` and `diverged` those with a digest on both passes; `unverified` the
    rest (a ledger written before digests, or a trainer that recorded none). `pending`: steps the attempt has yet to
    train again, with their first pass (the tracker compares them as they come).
    """

    replayed: int = 0
    equal: int = 0
    diverged: int = 0
    first_divergence: Divergence | None = None
    pending: Mapping[int, tuple[str, Digest | None]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def unverified(self) -> int:
        """Replayed steps without a digest on both passes to compare."""
        return self.replayed - self.equal - self.diverged

    @property
    def through(self) -> int | None:
        """The last step still to be trained again (None: nothing pending)."""
        return max(self.pending) if self.pending else None

    def __add__(self, other: Replay) -> Replay:
        """Both together, in order: the first divergence is this one's if it has one; `other`'s pending."""
        return Replay(
            self.replayed + other.replayed,
            self.equal + other.equal,
            self.diverged + other.diverged,
            self.first_divergence or other.first_divergence,
            other.pending,
        )

    def text(self) -> str:
        """``replayed 50 steps: 50 bitwise equal`` or ``... diverged first at step 1234: loss ... vs ..., batch
        equal`` and the explain command on a second line; "" when no step was trained twice."""
        if not self.replayed:
            return ""
        counts = [f"{self.equal} bitwise equal"]
        if self.diverged:
            counts.append(f"{self.diverged} diverged")
        if self.unverified:
            counts.append(f"{self.unverified} without a digest on both passes")
        line = f"replayed {self.replayed} step(s): {', '.join(counts)}"
        d = self.first_divergence
        if d is None:
            return line
        return f"{line}; diverged first at step {d.step}: {d.text()}\n  its batch: {d.explain}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "equal": self.equal,
            "diverged": self.diverged,
            "unverified": self.unverified,
            "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
        }


class FirstPasses:
    """The latest pass of every step the attempts so far trained (the latest one with a digest, else the latest)."""

    def __init__(self) -> None:
        self._latest: Expected = {}
        self._steps: list[int] = []  # the keys of `_latest` in order, for `after` to find its first one by bisection

    def add(self, attempt: str, digests: Mapping[int, Digest | None]) -> None:
        """The steps one attempt trained (step -> digest), after the attempts added before it."""
        latest = self._latest
        new = sorted(step for step in digests if step not in latest)  # (keys() - keys() would walk all of latest)
        for step, digest in digests.items():
            if digest is not None or latest.get(step, (None, None))[1] is None:
                latest[step] = (attempt, digest)
        if new and self._steps and new[0] < self._steps[-1]:  # below a step trained before: merged in order
            self._steps = sorted(self._steps + new)
        else:
            self._steps += new

    def after(self, resume: float) -> Expected:
        """What an attempt that resumed after step `resume` trains again: the steps above it, with their pass. Found
        by bisection: scanning every step once per attempt made a job's attribution quadratic in its attempts."""
        return {step: self._latest[step] for step in self._steps[bisect.bisect_right(self._steps, resume) :]}


def compare(
    expect: dict[int, tuple[str, Digest | None]], attempt: str, steps: Iterable[tuple[int, Digest | None]], root: str
) -> Replay:
    """Compare an attempt's steps (in the order it trained them; the first record of a step counts) with their
    first pass, popped from `expect`: what is left of it is pending. `root`: the checkpoint root explain reads."""
    replayed = equal = diverged = 0
    first = None
    for step, again in steps:
        found = expect.pop(step, None)
        if found is None:
            continue
        replayed += 1
        earlier, before = found
        if before == again and before is not None:  # the common case, at C speed
            equal += 1
            continue
        before, again = _digest(before), _digest(again)
        same = _same(before, again)
        if same is None:
            continue
        if same:
            equal += 1
            continue
        diverged += 1
        if first is None:
            command = f"python -m ckpt explain {shlex.quote(root)} --step {step}"
            first = Divergence(step, attempt, earlier, before, again, command)
    return Replay(replayed, equal, diverged, first, expect)


def _digest(d: tuple | None) -> Digest | None:
    return None if d is None else Digest._make(d)


def _same(a: Digest | None, b: Digest | None) -> bool | None:
    """Whether two passes agree in every field both recorded; None when they share none."""
    if a is None or b is None:
        return None
    pairs = [(x, y) for x, y in ((a.loss, b.loss), (a.batch, b.batch)) if x is not None and y is not None]
    first, again = dict(a.scalars), dict(b.scalars)
    pairs += [(first[k], again[k]) for k in first.keys() & again.keys()]
    return all(x == y for x, y in pairs) if pairs else None
