"""Helpers shared by the trainer adapters: tracker ownership, the advised interval, step resolution, save-once,
read-all, delete, the batch hash a step record carries."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ettr
from ckpt import CheckpointManager, RNGState, SaveHandle, StepExistsError
from ettr import GoodputTracker


def check_flag(name: str, value: Any) -> bool:
    """A True/False argument, refused at construction otherwise (``"no"`` would read as True)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def lacks(obj: Any, *methods: str) -> list[str]:
    """The methods of `methods` that `obj` does not have (an argument checked for the duck type it must be)."""
    return [m for m in methods if not callable(getattr(obj, m, None))]


def check_decision(decision: Any) -> Any:
    """A `ckpt.SaveDecision` (``should_save`` and ``saved`` methods), refused at construction otherwise."""
    missing = lacks(decision, "should_save", "saved")
    if missing:
        raise TypeError(f"decision must be a ckpt.SaveDecision (e.g. EveryNSteps(100)), got {decision!r}: no {missing}")
    return decision


def check_rng(rng: Any) -> Any:
    """True, False or a `ckpt.RNGState`, refused at construction otherwise (``"yes"`` was saved as a string)."""
    if not (type(rng) is bool or isinstance(rng, RNGState)):
        raise TypeError(f"rng must be True, False or a ckpt.RNGState, got {rng!r}")
    return rng


def check_samplers(samplers: Any) -> dict[str, Any]:
    """Name -> ckpt sampler, refused at construction otherwise (a list would be iterated as pairs: a sampler's
    endless iteration hung the constructor)."""
    if samplers is None:
        return {}
    if not isinstance(samplers, Mapping):
        raise TypeError(f"samplers must map a name to each ckpt sampler, e.g. {{'train': sampler}}, got {samplers!r}")
    for name, s in samplers.items():
        missing = lacks(s, "advance", "state_dict", "load_state_dict")
        if not isinstance(name, str) or missing:
            raise TypeError(
                f"samplers[{name!r}] must be a ckpt sampler (ShuffledSampler, RandomWindowSampler) under a str name, "
                f"got {s!r}" + (f": no {missing}" if missing else "")
            )
    return dict(samplers)


KEYS = "keys"  # metadata entry listing a checkpoint's top-level keys, so it can be read without a template


class TrackerLease:
    """The GoodputTracker of one training call: the caller's (they start/end it) or one made here for `root`, reached
    with the manager's `storage_options` (an object store's endpoint: the ledger goes where the checkpoints go)."""

    def __init__(
        self, root: str | None, tracker: GoodputTracker | None, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        if tracker is not None and not isinstance(tracker, GoodputTracker):
            raise TypeError(f"tracker must be an ettr.GoodputTracker, got {tracker!r}")
        self.root, self.given = root, tracker
        self.storage_options = storage_options
        self.tracker: GoodputTracker | None = tracker
        self._open = False

    def start(
        self, root: str | None = None, rank: int | None = None, storage_options: Mapping[str, Any] | None = None
    ) -> GoodputTracker:
        """Return the tracker to report to; an owned one is new per call (one ledger per attempt) and started, as
        `rank` (None: the launcher's RANK), in `root` reached with `storage_options` (those of the checkpoint root it
        defaults to) or else in the lease's own root and options."""
        if self.given is not None:
            return self.given
        if self.root is not None:
            root, storage_options = self.root, self.storage_options
        if root is None:
            raise ValueError("no root for the goodput ledger: pass root= or tracker=")
        if not self._open:
            options = dict(storage_options) if storage_options is not None else None
            self.tracker = GoodputTracker(root, rank=rank, storage_options=options).start()
            self._open = True
        return self.tracker

    def end(self, status: str) -> None:
        """End an owned tracker once ("ok", or "error" for a disruption); the caller's is left to the caller."""
        if self._open:
            self._open = False
            self.tracker.end(status)


ADVICE_SHARE = 0.01  # the most of the wall time refits may take in the training thread...
ADVICE_FREE_S = 0.05  # ...once one costs more CPU than this (a long live attempt); a cheaper one is never skipped


def advised_interval(
    root: str,
    mttf_s: float | None = None,
    storage_options: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
    cpu_clock: Callable[[], float] = time.thread_time,
) -> Callable[[], float | None]:
    """The interval provider of a `ckpt.AdvisedInterval`: the seconds `ettr.advise` fits to the job's ledgers in
    `root` (`mttf_s` overrides the fitted MTTF; `storage_options` as the manager's), or None while the run is too
    short to fit one (`Advice.too_short`: no save yet, or, without `mttf_s`, less compute than the fitted interval). T_write is the
    stall per save plus optimizer steps' waits for an overlapped snapshot: what training loses per save
    (docs/goodput.md).

    ckpt does not import ettr: this is where the two meet. A save still being written may not be in the ledger yet;
    the next answer includes it. Ledgers that cannot be read (`_readable_attribution`) answer None, with a warning.
    Each answer reads the ledgers through one `ettr.RootFollower`: an ended attempt's ledger is read once, so an
    answer costs what the live attempt's ledger costs, not what the whole job's does. That cost grows with the live
    attempt (~20 us a step): once a refit costs the training thread over ADVICE_FREE_S of CPU (`cpu_clock`: its
    thread's, so a busy machine does not inflate it), the next ones are skipped (None: the interval stays) until
    1/ADVICE_SHARE times that cost has passed (`clock`, wall seconds), so refits keep to 1% of the time.
    """

    job = ettr.RootFollower(root, storage_options)

    def interval_s() -> float | None:
        attribution = _readable_attribution(job)
        if attribution is None or not attribution.save_us:
            return None
        advice = ettr.advise(attribution, mttf_s=mttf_s)
        return None if advice.too_short else advice.recommended_interval_s

    return _within_share(interval_s, clock, cpu_clock)


def _within_share(
    refit: Callable[[], Any], clock: Callable[[], float], cpu_clock: Callable[[], float]
) -> Callable[[], Any]:
    """`refit`, skipped (None: no new advice, the schedule in force stays) after a call that cost over ADVICE_FREE_S
    (`cpu_clock`) until that cost / ADVICE_SHARE has passed (`clock`) since it ended."""
    due = -math.inf

    def call() -> Any:
        nonlocal due
        if clock() < due:
            return None
        begin = cpu_clock()
        try:
            return refit()
        finally:
            cost = cpu_clock() - begin
            due = clock() + cost / ADVICE_SHARE if cost > ADVICE_FREE_S else -math.inf

    return call


def _readable_attribution(job: ettr.RootFollower) -> ettr.Attribution | None:
    """The job's attribution for an advisor, None (with a warning) when its ledgers cannot be read: a damaged ledger
    (a bad line, a stray file named like one) or a store that does not answer costs the advice, not the training,
    as it costs the tracker's telemetry only (the schedule in force stays)."""
    try:
        return job.attribute()
    except (ettr.LedgerError, OSError) as e:
        warnings.warn(
            f"the goodput ledgers cannot be read ({e}): the checkpoint interval stays as it is, not advised",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def batch_hash(samplers: Mapping[str, Any], step: int | None = None) -> str | None:
    """The hash of the batch of `step` (None: of each sampler's next batch, the one being trained before it
    advances) for the goodput ledger's replay check: the `ckpt` sampler's ``batch_hash``, several joined as
    ``name:hash,...`` in name order; None without one (another sampler cannot say)."""
    found = [
        (name, s.batch_hash(s.step + 1 if step is None else step))
        for name, s in sorted(samplers.items())
        if hasattr(s, "batch_hash")
    ]
    if len(found) < 2:
        return found[0][1] if found else None
    return ",".join(f"{name}:{digest}" for name, digest in found)


def advised_two_tier(
    root: str,
    mttf_s: float | None = None,
    storage_options: dict[str, Any] | None = None,
    inputs: ettr.TwoTierInputs | None = None,
    clock: Callable[[], float] = time.monotonic,
    cpu_clock: Callable[[], float] = time.thread_time,
) -> Callable[[], tuple[float, int] | None]:
    """The advice of a `ckpt.AdvisedTiers`: the (local interval in seconds, K) that `ettr.advise_two_tier` fits to the
    job's ledgers in `root` (per-tier save and restore costs, the failure classes seen so far; `inputs` for what the
    ledger cannot tell, e.g. ``persist_s``), or None until it has a plan (no save yet, no failure classified, or
    ledgers that cannot be read: `_readable_attribution`). The ledgers are read, and refits skipped to keep them
    within 1% of the time, as for `advised_interval`."""

    job = ettr.RootFollower(root, storage_options)

    def advice() -> tuple[float, int] | None:
        attribution = _readable_attribution(job)
        if attribution is None:
            return None
        plan = ettr.advise_two_tier(attribution, inputs or ettr.TwoTierInputs(), mttf_s=mttf_s).plan
        return None if plan is None else (plan.interval_s, plan.persist_every)

    return _within_share(advice, clock, cpu_clock)


def resolve_step(manager: CheckpointManager, step: int) -> int | None:
    """`step` if committed, else the newest committed step before it (with a warning): a save that died unfinished.

    None when the root has no committed step at all (the run died before its first save committed): there is nothing
    to resume, and the caller decides whether that is a fresh start. Committed steps that are all newer than `step`
    raise FileNotFoundError: falling back is impossible and starting fresh would pass over them.
    """
    committed = manager.steps()
    if step in committed:
        return step
    if not committed:
        return None
    earlier = [s for s in committed if s < step]
    if not earlier:
        raise FileNotFoundError(
            f"step {step} is not committed in {manager.storage.url} and no earlier step is (committed: {committed})"
        )
    warnings.warn(
        f"checkpoint step {step} was never committed in {manager.storage.url} (the process died while "
        f"writing it); resuming from step {earlier[-1]} instead",
        RuntimeWarning,
        stacklevel=3,
    )
    return earlier[-1]


def refuse_rollback(manager: CheckpointManager, step: int, newest_named_by: Callable[[int], str] | None = None) -> None:
    """Training on from `step` while later steps of the root are committed would fail at the first save that repeats
    one (a committed step is never overwritten), after its compute was spent: refuse it before training, saying how
    to roll back (or resume the newest: `newest_named_by(step)` says how, where the trainer has a way to name it)."""
    committed = manager.steps()
    newer = [int(s) for s in committed if s > step]
    if newer:
        local = f" --local {manager.local_root}" if manager.local_root is not None else ""
        url = manager.storage.url
        # `ckpt rollback` keeps a step at or before `step` to resume; where none is (a stock HF folder older than the
        # root's first step), deleting them is deleting the root
        roll_back = (
            f"To roll back (deletes them): python -m ckpt rollback {url} --to {step}{local}"
            if len(newer) < len(committed)
            else f"Every committed step is after step {step}: to roll back, delete or move the root {url}"
            f"{f' and its local tier {manager.local_root}' if local else ''}"
        )
        raise StepExistsError(
            f"resuming from step {step}, but steps {newer} of {url}{' (and its local tier)' if local else ''} are "
            f"committed after it: training on would save them again, and a committed step is never overwritten. No "
            f"step was written. {roll_back}; to go on, resume the newest step"
            f"{newest_named_by(newer[-1]) if newest_named_by else ''}"
        )


def never_committed(manager: CheckpointManager, step: int, named_by: str) -> str:
    """The message for a resume from `step` (named by `named_by`) of a root where no step is committed."""
    return (
        f"{named_by} names step {step} of {manager.storage.url}, which was never committed, and no step of the root "
        f"is (the process died before its first save committed)"
    )


def save_once(
    manager: CheckpointManager,
    step: int,
    state: Mapping[str, Any],
    *,
    skip: Sequence[int | None] = (),
    metadata: Mapping[str, Any] | None = None,
) -> SaveHandle | None:
    """Start an async save of `step` unless it is in `skip` (saved or restored by this process); its handle if started.

    A trainer may ask twice for one step (a batch-end and an epoch-end save, `last` and a named copy); the
    training state is the same, so the first write stands.
    """
    if step in skip:
        return None
    # a step committed before (by another run) is refused by manager.save itself (StepExistsError): one check
    return manager.save(step, state, metadata={**(metadata or {}), KEYS: sorted(state)})


def read_step(
    manager: CheckpointManager,
    step: int,
    keys: Sequence[str] | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore a committed step into fresh values (tensors on CPU, state dicts as plain dicts), all keys or `keys`;
    `metadata`: the step's, when the caller has read it already (else it is read here)."""
    saved = (metadata if metadata is not None else manager.metadata(step)).get(KEYS)
    if saved is None:
        raise ValueError(
            f"step {step} of {manager.storage.url} was not written by a trainer integration "
            f"(its metadata lists no '{KEYS}')"
        )
    target: dict[str, Any] = dict.fromkeys(keys if keys is not None else saved)
    manager.restore(target, step=step, keys=list(target))
    return target


def delete_step(manager: CheckpointManager, step: int) -> bool:
    """Delete a committed step that is not the newest committed one (the one a resume needs); True if deleted.

    False, and nothing deleted, for a step the manager refuses to delete now: not committed (or already being
    deleted), the newest, still being written, or, with a local tier, still being persisted to the durable root (a
    save can follow its step's local commit before that copy ends): a later call deletes it. Its other errors (a
    background write's, a lost lease) are raised. The manager's check lists the committed steps once.
    """
    try:
        manager.delete(step)
    except ValueError:  # StepNotFoundError, or the newest / being written / being persisted: not now
        return False
    return True
