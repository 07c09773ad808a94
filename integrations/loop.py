"""A plain PyTorch loop wired to ckpt + ettr: restore on entry, interval and just-in-time saves, goodput tracking.

Policy stays in `ckpt` (what a save is, what a restore finds, when one is due: `ckpt.schedule`) and `ettr` (what
time counts as, which interval pays); this object only asks them at each step boundary, wires the advisor into the
save decision and owns the signal handlers. Steps are counted 1-based:
``on_step_end(s)`` means s steps are done, a checkpoint of it is ``step_<s>``, and a restore of it resumes at s + 1.
A planned end keeps every step: the last step of ``steps(total)`` is saved, and so is the last ended step at a clean
exit of the ``with`` block (a ``break``). A preemption logs one line (logger ``integrations``, WARNING: shown on
stderr without any logging setup) naming the signal, the step saved, how long the save took and the exit status.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ckpt import (
    AdvisedInterval,
    AdvisedTiers,
    AnyOf,
    CheckpointManager,
    EveryNSeconds,
    EveryNSteps,
    Preemption,
    RNGState,
    SaveDecision,
    SaveHandle,
    Stateful,
)
from ckpt.options import typed
from ckpt.schedule import PREEMPTION_SIGNALS
from ettr import GoodputTracker

from ._common import (
    advised_interval,
    advised_two_tier,
    batch_hash,
    check_decision,
    check_flag,
    check_rng,
    lacks,
)

log = logging.getLogger("integrations")


class Preempted(SystemExit):
    """Raised by `on_step_end` once the just-in-time checkpoint a SIGTERM/SIGUSR1 asked for is committed."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(128 + signum)  # the exit status a shell reports for death by that signal
        self.signum, self.step = signum, step


class TrainLoop:
    """Owns a CheckpointManager, a GoodputTracker and the RNG/data state of one training process.

    Usage::

        with TrainLoop(root, {"model": model, "optim": optim}, sampler=sampler, every_steps=100) as loop:
            for step in loop.steps(total_steps):        # resumes after loop.start_step
                ...forward, backward...
                optim.step()
                loop.on_step_end(step, {"loss": loss.item()})  # a due save copies the whole state, then returns

    Args:
        root: checkpoint root (path or URL); the goodput ledgers live in ROOT/ettr/.
        state: the user's entries (modules, optimizers, schedulers, tensors, JSON values).
        sampler: a checkpointable sampler, saved as ``state["sampler"]``.
        rng: True for a default `RNGState` (every global RNG), an `RNGState` with registered generators, or False;
            saved as ``state["rng"]``.
        every_steps, every_seconds: save when either many steps or seconds have passed since the last save.
        advise: after each save, move the interval toward the one `ettr.advise` fits to this job's ledgers
            (seconds; `mttf_s` overrides the fitted MTTF), damped and bounded (`ckpt.Retune`); with a local tier,
            the pair (local interval, K) `ettr.advise_two_tier` fits (`ckpt.AdvisedTiers`), K going to the manager's
            `persist_every`. The intervals above (and `persist_every`) are its starting point.
        decision: a `ckpt.schedule.SaveDecision` instead of the three above (e.g. one shared with other code).
        signals: preemption signals; one sets a flag, the next `on_step_end` saves that step and raises `Preempted`.
        overlap: deprecated: ``overlap=True`` is ``snapshot="overlap"`` (a manager option, below), unless
            ``snapshot=`` is given. By default (``snapshot="sync"``) a save copies the whole state before it
            returns, so whatever the loop's code does next (user hooks, an EMA swap, weight clipping through
            ``.data``) cannot reach the checkpoint. ``snapshot="overlap"`` copies the parameters and optimizer
            state beside the next forward and backward and makes ``optimizer.step()`` wait for that copy: a
            shorter stall, on the condition that nothing but ``optimizer.step()`` writes them before that step
            (or `wait_for_staging()` is called first; see `CheckpointManager`).
        tracker: an unstarted GoodputTracker (e.g. with OpenTelemetry metrics); default ``GoodputTracker(root)`` with
            the manager's ``storage_options``.
        manager_options: passed to `CheckpointManager` (retention, staging cap, chunk size, ``snapshot``, and two
            tiers: ``local=DIR, persist_every=K, keep_local=N``; the preemption save is then persisted too).
    """

    def __init__(
        self,
        root: str,
        state: Mapping[str, Any],
        *,
        sampler: Stateful | None = None,
        rng: RNGState | bool = True,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        advise: bool = False,
        mttf_s: float | None = None,
        decision: SaveDecision | None = None,
        signals: Sequence[int] = PREEMPTION_SIGNALS,
        overlap: bool = False,
        tracker: GoodputTracker | None = None,
        **manager_options: Any,
    ) -> None:
        reserved = [k for k, on in (("rng", rng is not False), ("sampler", sampler is not None)) if on and k in state]
        if reserved:
            raise ValueError(f"state keys {reserved} are reserved for the loop's own entries; rename them")
        for name, flag in (("advise", advise), ("overlap", overlap)):  # "no" would read as True
            check_flag(name, flag)
        if decision is not None and (every_steps is not None or every_seconds is not None or advise):
            raise ValueError("give decision= or every_steps/every_seconds/advise, not both")
        if not isinstance(root, (str, os.PathLike)):  # None became a folder named 'None'
            raise TypeError(f"root must be a path or URL, got {root!r}")
        if mttf_s is not None and not (type(mttf_s) in (int, float) and 0 < mttf_s < math.inf):
            raise ValueError(f"mttf_s must be a finite positive number of seconds, got {mttf_s!r}")
        if tracker is not None and not isinstance(tracker, GoodputTracker):  # the loop starts it itself
            raise TypeError(f"tracker must be an unstarted ettr.GoodputTracker, got {tracker!r}")
        self.root = os.fspath(root)
        self.mttf_s = mttf_s
        if overlap:
            warnings.warn(
                "TrainLoop(overlap=True) is deprecated: pass snapshot='overlap' (the manager's option: the parameters "
                "and optimizer state are copied beside the next forward and backward, and optimizer.step() waits for "
                "that copy; nothing else may write them before that step)",
                DeprecationWarning,
                stacklevel=2,
            )
            if manager_options.get("snapshot") is None and manager_options.get("write") is None:
                manager_options["snapshot"] = "overlap"
        self._manager_options = typed(manager_options)  # checked now, where the loop is configured
        # one configuration for the root's store
        self._storage_options = self._manager_options["root_options"].storage_options
        self.rng = RNGState() if check_rng(rng) is True else (rng or None)
        if sampler is not None and lacks(sampler, "state_dict", "load_state_dict"):
            raise TypeError(f"sampler must be checkpointable (state_dict and load_state_dict), got {sampler!r}")
        self.sampler = sampler
        self._samplers = {"sampler": sampler} if sampler is not None else {}
        self.state: dict[str, Any] = {
            **state,
            **({"rng": self.rng} if self.rng else {}),
            **({"sampler": sampler} if sampler is not None else {}),
        }
        self.preemption = Preemption(signals)
        self.tracker = (
            tracker if tracker is not None else GoodputTracker(self.root, storage_options=self._storage_options)
        )
        self.decision = (
            check_decision(decision) if decision is not None else self._interval(every_steps, every_seconds, advise)
        )
        self._handle: SaveHandle | None = None  # the last save, whose snapshot `wait_for_staging` waits for
        self._open_step: int | None = None
        self._live = False  # inside the `with` block: a manager to save to, a ledger to record in
        self.manager: CheckpointManager | None = None
        self.start_step = self.step = self.last_saved = 0
        self._total: int | None = None  # the last step of the job, once steps(total) gave it
        self._metrics: Mapping[str, Any] | None = None  # those of the last ended step, for the save at a clean exit

    def _interval(self, every_steps: int | None, every_seconds: float | None, advise: bool) -> SaveDecision:
        """The save decision the interval arguments describe (each part checks its own value)."""
        parts: list[SaveDecision] = []
        if every_steps is not None:
            parts.append(EveryNSteps(every_steps))
        if every_seconds is not None:
            parts.append(EveryNSeconds(every_seconds))
        if not parts:
            raise ValueError("give every_steps or every_seconds (with advise=True: the interval it starts from)")
        interval = parts[0] if len(parts) == 1 else AnyOf(*parts)
        tiers = self._manager_options["tiers"]
        if not advise:
            return interval
        ledgers = (self.tracker.root, self.mttf_s, self.tracker.storage_options)  # where the tracker keeps them
        if tiers is not None:  # the pair (local interval, K), refitted from this run's ledger after each save
            return AdvisedTiers(advised_two_tier(*ledgers), interval, tiers.persist_every)
        return AdvisedInterval(advised_interval(*ledgers), interval)

    # -- lifetime ------------------------------------------------------------------------------------------
    def __enter__(self) -> TrainLoop:
        """Take the root's writer lease, start the ledger, install the signal handlers, restore the newest checkpoint
        (sets `start_step`). A second writer of the root fails here (`LeaseHeldError`), before it starts a ledger
        among the live writer's attempts or trains an interval it could not save. A loop is entered once (its tracker
        records one attempt): a nested or second ``with`` of it is refused before it touches the root."""
        if self.manager is not None:
            raise RuntimeError(
                f"this TrainLoop of {self.root} was entered already (one `with` block per loop: its tracker records "
                f"one attempt); make a new TrainLoop for another attempt"
            )
        if self.preemption.signals and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(  # signal.signal's ValueError came after the ledger began: a failed attempt recorded
                f"a TrainLoop with preemption signals {[signal.Signals(s).name for s in self.preemption.signals]} is "
                f"entered in thread {threading.current_thread().name!r}: Python installs signal handlers in the main "
                f"thread only; enter it there, or pass signals=[] (no just-in-time save on a preemption notice)"
            )
        manager = CheckpointManager(self.root, tracker=self.tracker, **self._manager_options)
        try:
            manager.hold_lease()
            self.tracker.start()  # a tracker started already fails here: the lease goes with the manager
        except BaseException:
            manager.close()
            raise
        self.manager, self._live = manager, True
        try:
            self.preemption.install()
            self.start_step = self.step = self.last_saved = self.manager.restore(self.state) or 0
            self._decided(self.start_step)
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        """At a clean exit save the last ended step (`save_last`); drain writes and release the root (also when that
        save fails), restore the previous signal handlers, end the ledger: ``error`` when the exit itself raised (its
        last steps are not saved)."""
        status = "ok" if exc_type is None else "preempted" if isinstance(exc, Preempted) else "error"
        try:
            if exc_type is None:
                with self.manager:  # closed whatever save_last raised; a write error is raised, never masks its own
                    self.save_last()
            else:  # keep the loop's exception; still drain what can be drained
                self.manager.__exit__(exc_type, exc, tb)
        except BaseException:
            status = "error"
            raise
        finally:
            self._live = False
            self.preemption.uninstall()
            self.tracker.end(status)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived (the next `on_step_end` saves and raises `Preempted`)."""
        return self.preemption.requested

    # -- the step path ------------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Step numbers after the last ended (or restored) one .. total, each timed as productive until its
        `on_step_end`; a second call (a second phase of training) goes on where the first ended."""
        if type(total) is not int:  # "10" failed inside range() naming neither the call nor the argument
            raise TypeError(f"loop.steps(total): total must be an int (the last step), got {total!r}")
        self._total = total
        for step in range(self.step + 1, total + 1):
            self.step_begin(step)
            yield step

    def step_begin(self, step: int) -> None:
        """Start timing step `step` (what `steps()` does for you). Step numbers only go up, from 1: a checkpoint is
        named by its step, so a counter restarting each epoch would save nothing new and resume from an old step."""
        self._check_live(f"step_begin({step})")
        if self._open_step is not None:
            raise RuntimeError(f"step {self._open_step} was never ended: call loop.on_step_end({self._open_step})")
        if type(step) is not int:  # a numpy integer passed the tracker, trained an interval and failed the save
            raise TypeError(f"step_begin({step!r}): step must be an int, got {type(step).__name__}; pass int(step)")
        if step <= self.step:
            restored = " (restored)" if self.step and self.step == self.start_step else ""
            raise ValueError(
                f"step_begin({step}) after step {self.step}{restored}: step numbers only go up, from 1 (a checkpoint "
                f"is named by its step: count steps across epochs, not within one)"
            )
        self.tracker.step_begin(step)
        self._open_step = step

    def on_step_end(self, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """End step `step`; save if the interval is due; after a preemption signal save it and raise `Preempted`.

        Returns True when a checkpoint of `step` was started. `metrics` go into the checkpoint's metadata
        (for keep_best retention); its ``"loss"``, with the sampler's batch hash, into the step's goodput record, where
        a step trained again after a resume is compared with its first pass (docs/goodput.md, replay verification).
        """
        if self._open_step != step:
            raise RuntimeError(
                f"on_step_end({step}) without step_begin({step}): iterate loop.steps(total) "
                f"or call loop.step_begin(step) first"
            )
        if metrics is not None and not isinstance(metrics, Mapping):  # checked while the step is still open
            raise TypeError(f"on_step_end({step}, metrics): metrics must map a name to a value, got {metrics!r}")
        behind = getattr(self.sampler, "step", None)
        if hasattr(self.sampler, "batch_hash") and behind < step:  # a ckpt sampler nothing advanced
            raise RuntimeError(
                f"step {step} ended with the sampler at step {behind}: iterate sampler.track(loader) (or call "
                f"sampler.advance() per step), else checkpoints hold a stale data position and a resume replays data"
            )
        loss = metrics.get("loss") if metrics else None
        self.tracker.step_end(step, loss, batch=batch_hash(self._samplers, step))
        self._open_step = None
        self.step, self._metrics = step, metrics
        signum, due = self.preemption.signum, self.decision.should_save(step, time.monotonic())
        if self.manager.ranks.world_size > 1:  # one answer for all: a signal on any rank, a decision on any (a clock)
            agreed, due = self.manager.ranks.max_ints([signum or 0, int(due)])
            signum = agreed or None
        if signum is not None:  # with two tiers also persisted: the job may come back on another node
            self._save_and_exit(signum, step, metrics)
        if step == self._total:  # the job's end: saved whatever the interval says, persisted with two tiers
            return self.save(step, metrics, persist=True)
        if due:
            return self.save(step, metrics)
        if step == self.start_step + 1:  # the optimizer's state exists now: the first save copies into warm memory
            self.manager.reserve(self.state)
        return False

    def _save_and_exit(self, signum: int, step: int, metrics: Mapping[str, Any] | None) -> None:
        """The just-in-time save a preemption signal asked for: save `step`, wait for its commit, say so in one log
        line, raise `Preempted` (the exit status of death by that signal)."""
        began = time.monotonic()
        started = self.save(step, metrics, persist=True)
        self.manager.wait()
        exit_code = 128 + signum
        log.warning(
            "%s received: checkpoint of step %d committed%s in %.3f s; exiting with status %d",
            signal.Signals(signum).name,
            step,
            "" if started else " (saved before the signal)",
            time.monotonic() - began,
            exit_code,
        )
        raise Preempted(signum, step)

    def save_last(self) -> bool:
        """Save the last ended step unless it is saved already (persisted with two tiers); True if started.

        The ``with`` block calls it at a clean exit, so a planned end (``steps(total)`` run out, or a ``break``)
        loses no step. A step begun but never ended is not saved: its state may be half updated; a warning says
        which step the root resumes from instead."""
        self._check_live("save_last()")
        if self._open_step is not None:
            warnings.warn(
                f"step {self._open_step} was begun but never ended (loop.on_step_end): not saved; "
                f"{self.root} resumes after step {self.last_saved}",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return self.save(self.step, self._metrics, persist=True)

    def save(self, step: int, metrics: Mapping[str, Any] | None = None, *, persist: bool | None = None) -> bool:
        """Checkpoint `step` now unless it is already saved (restored or saved by this loop); True if started.
        `step` is the last ended step or the one open (after its ``optim.step()``): the state now is that step's, and
        a checkpoint named by another step would resume from the wrong state.

        With two tiers (``local=``), `persist` is `CheckpointManager.save`'s: True also persists the step to the
        durable root, None leaves it to ``persist_every``; True for a step this loop saved already persists it then
        (`CheckpointManager.persist`)."""
        self._check_live(f"save({step})")
        if step == self.last_saved:
            if persist and self._handle is not None:  # saved at its interval, now the last or the preemption's
                self.manager.persist(step)  # to the durable root too (nothing when it was, or with one root)
            return False
        if step not in (self.step, self._open_step):
            open_step = f", step {self._open_step} open" if self._open_step is not None else ""
            raise ValueError(
                f"loop.save({step}): the state is that of step {self.step}{open_step}; a checkpoint named {step} "
                f"would hold another step's state, and a resume from it would train from the wrong weights"
            )
        self._handle = self.manager.save(step, self.state, metadata=metrics, persist=persist)
        self.last_saved = step
        self._decided(step)
        return True

    def _check_live(self, call: str) -> None:
        """Refuse `call` outside the `with` block: before it there is no manager or ledger yet, after it they are
        closed (it failed deep inside them, naming neither the loop nor the block)."""
        if not self._live:
            when = "before it is entered" if self.manager is None else "after its `with` block ended"
            raise RuntimeError(
                f"loop.{call} on a TrainLoop of {self.root} {when}: call it inside `with TrainLoop(...) as loop:`"
            )

    def _decided(self, step: int) -> None:
        """Tell the save decision of a checkpoint of `step`; a retuned K (`AdvisedTiers`) goes to the manager."""
        self.decision.saved(step, time.monotonic())
        if isinstance(self.decision, AdvisedTiers):
            self.manager.persist_every = self.decision.persist_every

    def wait_for_staging(self) -> None:
        """Block until the last save's snapshot is complete (`SaveHandle.wait_snapshot`). By default a save copies
        everything before it returns, and this returns at once. With ``snapshot="overlap"`` it is needed before
        changing the parameters or optimizer state in place other than by ``optimizer.step()``, which waits by
        itself."""
        if self._handle is not None:
            self._handle.wait_snapshot()

    # -- live goodput ----------------------------------------------------------------------------------------
    def ettr(self) -> float:
        """Cumulative ETTR of the whole job so far, earlier attempts included (as this process sees it)."""
        totals = self.tracker.totals_us()
        wall = sum(totals.values())
        return totals.get("productive", 0) / wall if wall else 0.0
