"""Expected-ETTR models, optimal checkpoint intervals, a Monte Carlo simulator, and an advisor fitted to a ledger.

Throughout: `interval_s` is compute time between checkpoints, `write_s` the blocking cost of one save, `restart_s`
the cost of one failure besides lost work (downtime + startup + restore), `mttf_s` the job's mean time to failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .attribution import Attribution

NODE_DAY_S = 86_400.0
MAX_TRIES = 1e4  # simulate(): expected tries per segment (or per restart) beyond which it would not finish
MAX_DRAWS = 1e8  # simulate(): expected random draws in all (about a second of numpy)


def check_seconds(name: str, value: float, *, positive: bool = False) -> float:
    """`value` if it is a finite, non-negative (or positive) number of seconds; else a ValueError naming it."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(
            f"{name} must be a finite {'positive' if positive else 'non-negative'} number of seconds, got {value!r}"
        )
    return float(value)


def seed_ettr(interval_s: float, write_s: float, read_s: float, mttf_s: float) -> float:
    """First-order model: ETTR = 1 - T_read/MTTF - T_write/T_period - T_period/(2 MTTF)."""
    return 1.0 - read_s / mttf_s - write_s / interval_s - interval_s / (2.0 * mttf_s)


def young_interval(write_s: float, mttf_s: float) -> float:
    """Young's optimum of the seed model: sqrt(2 T_write MTTF)."""
    return math.sqrt(2.0 * write_s * mttf_s)


def daly_interval(write_s: float, mttf_s: float) -> float:
    """Daly's higher-order optimum (2006): sqrt(2dM)[1 + sqrt(d/2M)/3 + (d/2M)/9] - d for d < 2M, else M."""
    if write_s >= 2.0 * mttf_s:
        return mttf_s
    x = write_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * write_s * mttf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - write_s


def expected_ettr(interval_s: float, write_s: float, restart_s: float, mttf_s: float) -> float:
    """Exact expectation for exponential failures that may strike during compute, writes and restarts (Daly):
    ETTR = T / (M e^{R/M} (e^{(T+d)/M} - 1))."""
    m = mttf_s
    try:
        return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + write_s) / m))
    except OverflowError:  # failures come so much faster than a segment completes that nothing ever does
        return 0.0


def cluster_ettr(
    interval_s: float, n_nodes: int, failures_per_node_day: float, restart_s: float, write_s: float = 0.0
) -> float:
    """Cluster form: E[ETTR] = (1 - N r (u0 + T/2)) / (1 + T_write/T), r per node-day, u0 = restart_s."""
    rate = n_nodes * failures_per_node_day / NODE_DAY_S
    return (1.0 - rate * (restart_s + interval_s / 2.0)) / (1.0 + write_s / interval_s)


def mttf_from_rate(n_nodes: int, failures_per_node_day: float) -> float:
    """Job MTTF in seconds for N nodes each failing r times per node-day."""
    return NODE_DAY_S / (n_nodes * failures_per_node_day)


@dataclass(frozen=True)
class SimResult:
    """Simulated ETTR with its standard error and the failures seen."""

    ettr: float
    stderr: float
    failures: int
    segments: int


def simulate(
    interval_s: float, write_s: float, restart_s: float, mttf_s: float, *, segments: int = 200_000, seed: int = 0
) -> SimResult:
    """Monte Carlo: each segment (compute interval_s, then write write_s) is redone until no failure hits it; each
    failure costs restart_s, and a failure during a restart restarts it. Failures: Poisson in wall time.

    A ValueError instead of a run that would not finish: when a segment or a restart needs more than MAX_TRIES
    tries on average, or all segments more than MAX_DRAWS random draws (then the exact expectation is about 0).
    """
    check_seconds("interval", interval_s, positive=True)
    check_seconds("write", write_s)
    check_seconds("restart", restart_s)
    check_seconds("mttf", mttf_s, positive=True)
    if segments < 1:
        raise ValueError(f"segments must be at least 1, got {segments}")
    cycle = interval_s + write_s
    log_tries, log_restart_tries = cycle / mttf_s, restart_s / mttf_s  # expected tries: e^(x / MTTF)
    if (
        max(log_tries, log_restart_tries) > math.log(MAX_TRIES)
        or segments * math.exp(log_tries) * (1 + math.exp(log_restart_tries)) > MAX_DRAWS
    ):
        raise ValueError(
            f"not simulated: with {cycle:g} s per segment, {restart_s:g} s per restart and MTTF {mttf_s:g} s "
            f"a segment succeeds once in ~{math.exp(min(log_tries, 700)):.3g} tries and a restart once in "
            f"~{math.exp(min(log_restart_tries, 700)):.3g}; {segments} segments would not finish "
            f"(exact expected ETTR {expected_ettr(interval_s, write_s, restart_s, mttf_s):.3g})"
        )
    rng = np.random.default_rng(seed)
    wall = np.zeros(segments)
    pending = np.arange(segments)
    failures = 0
    while pending.size:
        x = rng.exponential(mttf_s, pending.size)
        ok = x >= cycle
        wall[pending[ok]] += cycle
        failed = pending[~ok]
        failures += failed.size
        wall[failed] += x[~ok]
        restarting = failed
        while restarting.size:  # each failure: restart_s, itself possibly interrupted
            y = rng.exponential(mttf_s, restarting.size)
            done = y >= restart_s
            wall[restarting[done]] += restart_s
            wall[restarting[~done]] += y[~done]
            failures += int((~done).sum())
            restarting = restarting[~done]
        pending = failed
    mean = wall.mean()
    ettr = interval_s / mean
    return SimResult(float(ettr), float(ettr * wall.std() / mean / math.sqrt(segments)), failures, segments)


@dataclass(frozen=True)
class Advice:
    """Costs fitted from a job's own ledger and the checkpoint interval they suggest."""

    write_s: float
    read_s: float
    startup_s: float
    restart_s: float
    mttf_s: float
    mttf_failures: int
    mttf_source: str
    step_s: float | None
    interval_s: float | None
    recommended_interval_s: float
    recommended_steps: int | None
    expected_ettr_current: float | None
    expected_ettr_recommended: float

    @property
    def gain(self) -> float | None:
        """Expected ETTR gained by switching to the recommended interval."""
        if self.expected_ettr_current is None:
            return None
        return self.expected_ettr_recommended - self.expected_ettr_current

    def text(self) -> str:
        """A few readable lines."""
        lines = [
            f"fitted: T_write {self.write_s:.3f} s, T_read {self.read_s:.3f} s, startup {self.startup_s:.3f} s, "
            f"restart cost {self.restart_s:.3f} s per failure",
            f"MTTF {self.mttf_s / 3600:.3f} h ({self.mttf_source}; rests on {self.mttf_failures} failure(s))",
        ]
        if self.interval_s is not None:
            lines.append(f"current interval {self.interval_s:.1f} s -> expected ETTR {self.expected_ettr_current:.4f}")
        steps = f" (~{self.recommended_steps} steps)" if self.recommended_steps else ""
        lines.append(
            f"recommended interval {self.recommended_interval_s:.1f} s{steps} (Daly) -> expected ETTR "
            f"{self.expected_ettr_recommended:.4f}" + (f", gain {self.gain:+.4f}" if self.gain is not None else "")
        )
        return "\n".join(lines)


def _mean(values: list[float], default: float = 0.0) -> float:
    """Arithmetic mean, `default` when empty."""
    return sum(values) / len(values) if values else default


def advise(attribution: Attribution, *, mttf_s: float | None = None) -> Advice:
    """Fit T_write, T_read, startup and MTTF from the job's own attribution and recommend a checkpoint interval.

    Without failures the MTTF is only a lower bound (the running time); pass `mttf_s` (e.g. mttf_from_rate) then.
    """
    if mttf_s is not None:
        check_seconds("mttf", mttf_s, positive=True)
    a = attribution
    write_s = _mean([us / 1e6 for us in a.save_us])
    read_s = _mean([us / 1e6 for us in a.restore_us])
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
    n_steps = sum(at.steps for at in a.attempts)
    step_s = compute_s / n_steps if n_steps else None
    interval_s = compute_s / len(a.save_us) if a.save_us and compute_s else None
    recommended = max(daly_interval(write_s, mttf_s), step_s or 0.0)
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
    )
