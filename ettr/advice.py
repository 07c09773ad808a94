"""Advice fitted to a job's ledgers: the measured costs and failure rate turned into the interval (one tier) or
the interval and K (two tiers) that maximise ETTR, with what the job would gain."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .attribution import LOCAL_TIERS, Attribution
from .formulas import (
    MAX_SECONDS,
    TwoTierCosts,
    TwoTierPlan,
    check_seconds,
    daly_interval,
    expected_ettr,
    optimal_two_tier,
)


@dataclass(frozen=True)
class Advice:
    """Costs fitted from a job's own ledger and the checkpoint interval they suggest."""

    write_s: float
    read_s: float
    startup_s: float
    restart_s: float
    mttf_s: float
    mttf_failures: int  # failures in the ledger: what a fitted MTTF rests on
    mttf_source: str
    step_s: float | None
    interval_s: float | None
    recommended_interval_s: float
    recommended_steps: int | None
    expected_ettr_current: float | None
    expected_ettr_recommended: float
    two_tier: TwoTierAdvice | None = None
    too_short: str | None = None  # why this run is too short to fit an interval (None: it is not)

    @property
    def gain(self) -> float | None:
        """Expected ETTR gained by switching to the recommended interval."""
        if self.expected_ettr_current is None:
            return None
        return self.expected_ettr_recommended - self.expected_ettr_current

    def text(self) -> str:
        """A few readable lines."""
        lines = [
            f"fitted: T_write {self.write_s:.3f} s (stall + overlap waits per save), T_read {self.read_s:.3f} s, "
            f"startup {self.startup_s:.3f} s, restart cost {self.restart_s:.3f} s per failure",
            f"MTTF {self.mttf_s / 3600:.3f} h ({self.mttf_source}; {self._failures_said()})",
        ]
        if self.too_short is not None:
            lines.append(f"run too short to fit a checkpoint interval: {self.too_short}")
        else:
            lines.append(
                "current interval: not measured, no compute came before a save (each one preceded the steps)"
                if self.interval_s is None
                else f"current interval {_secs(self.interval_s)} s -> expected ETTR {self.expected_ettr_current:.4f}"
            )
            steps = f" (~{self.recommended_steps} steps)" if self.recommended_steps else ""
            lines.append(
                f"recommended interval {_secs(self.recommended_interval_s)} s{steps} (Daly) -> expected ETTR "
                f"{self.expected_ettr_recommended:.4f}" + (f", gain {self.gain:+.4f}" if self.gain is not None else "")
            )
        if self.two_tier is not None:
            lines += ["", self.two_tier.text()]
        return "\n".join(lines)

    def _failures_said(self) -> str:
        """The failures the MTTF rests on; a given one rests on none of the ledger's, which it only shows."""
        verb = "the ledger shows" if self.mttf_source == "given" else "rests on"
        return f"{verb} {self.mttf_failures} failure(s)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the gain and the two-tier advice (its plan's derived intervals too)."""
        out = {k: v for k, v in self.__dict__.items() if k != "two_tier"}
        out["gain"] = self.gain
        out["two_tier"] = self.two_tier.to_dict() if self.two_tier is not None else None
        return out


def _secs(seconds: float | None) -> str:
    """Seconds readable at any scale: one decimal from 10 s, three significant digits below (never "0.0")."""
    return f"{seconds:.1f}" if seconds >= 10 else f"{seconds:.3g}"


# A run without a failure fits its MTTF as its running time, a lower bound; below this much running it says nothing.
MIN_UNFAILED_RUN_S = 3600.0


def _too_short(a: Attribution, compute_s: float, recommended_s: float, mttf_given: bool) -> str | None:
    """Why a run is too short to fit an interval (None: it is not): it took no save, ran no step or no compute; or, with the
    MTTF fitted from the run itself (no `mttf_s`), it saw no failure in less than MIN_UNFAILED_RUN_S of running, or
    the interval it would be advised is longer than all the compute it ran (an extrapolation)."""
    steps = sum(at.steps for at in a.attempts)
    if not steps or not a.saves:
        return f"{steps} step(s) and {a.saves} save(s) in the ledger; a fit needs at least one of each"
    if not compute_s:  # every step's time in spans of their own (a user's "forward"), or steps of no time
        return f"its {steps} step(s) hold no compute time (productive and lost: 0 s); a fit needs some"
    if mttf_given:
        return None
    running_s = (a.wall_us - a.micros["downtime"]) / 1e6
    if not a.failures and running_s < MIN_UNFAILED_RUN_S:
        return (
            f"no failure in {_secs(running_s)} s of running (under {MIN_UNFAILED_RUN_S:g} s, the MTTF is unknown); "
            "pass --mttf"
        )
    if recommended_s > compute_s:
        return (
            f"the fitted interval ({_secs(recommended_s)} s) is longer than all {_secs(compute_s)} s of compute "
            f"in its {steps} step(s); run longer, or pass --mttf"
        )
    return None


def _mean(values: list[float], default: float = 0.0) -> float:
    """Arithmetic mean, `default` when empty."""
    return sum(values) / len(values) if values else default


@dataclass(frozen=True)
class TwoTierInputs:
    """What the caller knows better than the ledger (None: fit it from the ledger): seconds per local save and per
    persist, per restore from each tier, and each failure class's MTTF."""

    local_write_s: float | None = None
    persist_s: float | None = None
    local_read_s: float | None = None
    durable_read_s: float | None = None
    local_mttf_s: float | None = None
    node_mttf_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value is not None:
                check_seconds(name, value, positive=name.endswith("mttf_s"))


# TwoTierInputs field -> the `python -m ettr advise` flag that sets it, for messages naming what is missing
TWO_TIER_FLAGS = {
    "local_write_s": "--local-write",
    "persist_s": "--persist-cost",
    "local_read_s": "--local-read",
    "durable_read_s": "--durable-read",
    "local_mttf_s": "--local-mttf",
    "node_mttf_s": "--node-mttf",
}


@dataclass(frozen=True)
class TwoTierAdvice:
    """The two-tier plan for a job: its fitted costs (each with where it came from), the optimal (T, K) and the gain
    over the best one-tier plan; `missing` names the flags to pass when the ledger cannot tell."""

    values: dict[str, float]  # TwoTierInputs field -> seconds, plus "restart_overhead_s"
    sources: dict[str, str]
    failure_classes: dict[str, int]
    missing: tuple[str, ...]
    costs: TwoTierCosts | None
    plan: TwoTierPlan | None
    step_s: float | None

    def steps(self, seconds: float) -> str:
        """` (~N steps)` when the step time is known."""
        return f" (~{max(1, round(seconds / self.step_s))} steps)" if self.step_s else ""

    def text(self) -> str:
        """A few readable lines: inputs with their sources, both intervals, the gain over one tier."""
        v, src, c = self.values, self.sources, self.failure_classes
        lines = [
            f"two tiers: failures by class: {c['local']} the local tier survived, {c['node']} it did not (node), "
            f"{c['unclassified']} unclassified"
        ]
        for name in ("local_write_s", "persist_s", "local_read_s", "durable_read_s", "restart_overhead_s"):
            if name in v:
                lines.append(f"  {name[:-2].replace('_', ' '):<17}{v[name]:>12.3f} s   {src[name]}")
        for name in ("local_mttf_s", "node_mttf_s"):
            if name in v:
                lines.append(f"  {name[:-2].replace('_', ' '):<17}{v[name] / 3600:>12.3f} h   {src[name]}")
        if self.plan is None:
            lines.append("  no two-tier plan: the ledger does not tell " + ", ".join(self.missing) + " (pass them)")
            return "\n".join(lines)
        p = self.plan
        lines += [
            f"two-tier plan: local every {p.interval_s:.1f} s{self.steps(p.interval_s)}, durable every "
            f"{p.persist_every} local saves ({p.durable_interval_s:.1f} s) -> expected ETTR {p.ettr:.4f}",
            f"best single tier: every {p.single_interval_s:.1f} s{self.steps(p.single_interval_s)} to the durable tier "
            f"-> expected ETTR {p.single_ettr:.4f}; two tiers gain {p.gain:+.4f}",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = asdict(self)
        if self.plan is not None:
            out["plan"].update(durable_interval_s=self.plan.durable_interval_s, gain=self.plan.gain)
        return out


def advise_two_tier(a: Attribution, inputs: TwoTierInputs, *, mttf_s: float | None = None) -> TwoTierAdvice:
    """Fit a two-tier plan from the job's own ledger where it can tell, from `inputs` otherwise.

    Restart overhead (downtime + startup) is the mean over all failures; a tier's restore, the mean restore from it
    (local: local or peer; durable: durable, else untiered restores of a one-tier job); a local save, the mean
    blocking save (none without a save); a persist costs nothing unless given (it runs in the background). Each
    class's MTTF: the job's failure rate (1/`mttf_s` if given) split by the classified failures' shares; a class never
    seen gets the running time (a lower bound).
    """
    values: dict[str, float] = {}
    sources: dict[str, str] = {}

    def put(name: str, given: float | None, fitted: float | None, how: str) -> None:
        if given is not None:
            values[name], sources[name] = given, f"given ({TWO_TIER_FLAGS[name]})"
        elif fitted is not None:
            values[name], sources[name] = fitted, how

    overheads = [
        (nxt.start_us - cur.end_us + nxt.micros.get("startup", 0)) / 1e6
        for cur, nxt in zip(a.attempts, a.attempts[1:])
        if cur.failed
    ]
    startups = [at.micros.get("startup", 0) / 1e6 for at in a.attempts]
    values["restart_overhead_s"] = _mean(overheads, _mean(startups))
    sources["restart_overhead_s"] = (
        f"ledger: downtime + startup, mean of {len(overheads)} failure(s)" if overheads else "ledger: mean startup"
    )
    fitted_write = a.save_cost_s if a.saves else None  # a run without a save tells no save's cost (not 0 s)
    put("local_write_s", inputs.local_write_s, fitted_write, "ledger: mean stall per save (+ overlap waits)")
    put("persist_s", inputs.persist_s, 0.0, "default: in the background, free to training")

    def restores(tiers: tuple[str | None, ...]) -> tuple[list[float], str]:
        found = a.restores(tiers)
        return found, f"ledger: mean of {len(found)} restore(s) from {'/'.join(t or 'one tier' for t in tiers)}"

    local, how = restores(LOCAL_TIERS)
    put("local_read_s", inputs.local_read_s, _mean(local) if local else None, how)
    durable, how = restores(("durable",))
    if not durable:
        durable, how = restores((None,))
    put("durable_read_s", inputs.durable_read_s, _mean(durable) if durable else None, how)

    classes = a.failure_classes
    classified = classes["local"] + classes["node"]
    running_s = (a.wall_us - a.micros["downtime"]) / 1e6
    rate = 1.0 / mttf_s if mttf_s is not None else a.failures / running_s if running_s > 0 else 0.0
    for name, cls in (("local_mttf_s", "local"), ("node_mttf_s", "node")):
        if not classified or running_s <= 0:
            put(name, getattr(inputs, name), None, "")
        elif classes[cls]:
            share = classes[cls] / classified
            put(name, getattr(inputs, name), 1.0 / (rate * share), f"ledger: {classes[cls]} of {classified} classified")
        else:
            put(name, getattr(inputs, name), running_s, "ledger: none seen, lower bound (running time)")
    missing = tuple(flag for name, flag in TWO_TIER_FLAGS.items() if name not in values)
    costs = plan = None
    if not missing:

        def restart(read: str) -> float:
            """Restart overhead + a restore from one tier, refused past MAX_SECONDS naming where each came from."""
            total = values["restart_overhead_s"] + values[read]
            if total > MAX_SECONDS:
                raise ValueError(
                    f"the {read[:-7]} restore ({values[read]:g} s, {sources[read]}) plus the restart overhead "
                    f"({values['restart_overhead_s']:g} s, {sources['restart_overhead_s']}) is over {MAX_SECONDS:g} s"
                )
            return total

        costs = TwoTierCosts(
            values["local_write_s"],
            values["persist_s"],
            restart("local_read_s"),
            restart("durable_read_s"),
            values["local_mttf_s"],
            values["node_mttf_s"],
        )
        plan = optimal_two_tier(costs, min_interval_s=_step_seconds(a) or 0.0)
    return TwoTierAdvice(values, sources, classes, missing, costs, plan, _step_seconds(a))


def _step_seconds(a: Attribution) -> float | None:
    """Mean compute seconds per step run (productive or lost), None without steps."""
    n_steps = sum(at.steps for at in a.attempts)
    return (a.micros["productive"] + a.micros["lost"]) / 1e6 / n_steps if n_steps else None


def _save_interval_s(a: Attribution) -> float | None:
    """Mean compute seconds (productive or lost) before a save, the model's checkpoint interval: each attempt's
    compute up to its last save, over the saves. The compute after an attempt's last save (what its failure lost, or
    the run's tail) ends in no save: counted, it made the interval look longer by the lost work. None without saves."""
    last_save: dict[int, int] = {}
    for s in a.segments:
        if s.category == "checkpoint_save":
            last_save[s.attempt] = s.end_us
    us = sum(
        s.end_us - s.begin_us
        for s in a.segments
        if s.category in ("productive", "lost") and s.end_us <= last_save.get(s.attempt, -1)
    )
    return us / 1e6 / a.saves if a.saves and us else None


def advise(attribution: Attribution, *, mttf_s: float | None = None, two_tier: TwoTierInputs | None = None) -> Advice:
    """Fit T_write, T_read, startup and MTTF from the job's own attribution and recommend a checkpoint interval.

    Without failures the MTTF is only a lower bound (the running time); pass `mttf_s` (e.g. mttf_from_rate) then.
    With `two_tier` (overrides, possibly all None) the advice also holds a two-tier plan (`advise_two_tier`).
    """
    if mttf_s is not None:
        check_seconds("mttf", mttf_s, positive=True)
    given_mttf = mttf_s
    a = attribution
    write_s = a.save_cost_s
    read_s = a.mean_restore_s() or 0.0  # the report's mean restore: one owner
    startup_s = _mean([at.micros.get("startup", 0) / 1e6 for at in a.attempts])
    restarts = [
        (nxt.start_us - cur.end_us + nxt.micros.get("startup", 0) + nxt.micros.get("checkpoint_restore", 0)) / 1e6
        for cur, nxt in zip(a.attempts, a.attempts[1:])
        if cur.failed
    ]
    restart_s = _mean(restarts, startup_s + read_s)
    failures = a.failures
    if mttf_s is not None:
        source = "given"
    else:
        running_s = (a.wall_us - a.micros["downtime"]) / 1e6
        mttf_s = running_s / max(failures, 1)
        source = "fitted from the ledger" if failures else "lower bound: no failure observed"
    compute_s = (a.micros["productive"] + a.micros["lost"]) / 1e6
    step_s = _step_seconds(a)
    interval_s = _save_interval_s(a)
    recommended = max(daly_interval(write_s, mttf_s), step_s or 0.0)
    too_short = _too_short(a, compute_s, recommended, given_mttf is not None)
    return Advice(
        write_s=write_s,
        read_s=read_s,
        startup_s=startup_s,
        restart_s=restart_s,
        mttf_s=mttf_s,
        mttf_failures=failures,
        mttf_source=source,
        step_s=step_s,
        interval_s=interval_s,
        recommended_interval_s=recommended,
        recommended_steps=max(1, round(recommended / step_s)) if step_s else None,
        expected_ettr_current=expected_ettr(interval_s, write_s, restart_s, mttf_s) if interval_s else None,
        expected_ettr_recommended=expected_ettr(recommended, write_s, restart_s, mttf_s) if recommended > 0 else 0.0,
        two_tier=advise_two_tier(a, two_tier, mttf_s=given_mttf) if two_tier is not None else None,
        too_short=too_short,
    )
