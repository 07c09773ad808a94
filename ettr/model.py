"""Expected-ETTR models, optimal checkpoint intervals, a Monte Carlo simulator, and an advisor fitted to a ledger.

Throughout: `interval_s` is compute time between checkpoints, `write_s` the blocking cost of one save, `restart_s`
the cost of one failure besides lost work (downtime + startup + restore), `mttf_s` the job's mean time to failure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from .attribution import LOCAL_TIERS, Attribution

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


# -- two tiers: a fast local tier every interval, a durable tier every K-th save ---------------------------------


@dataclass(frozen=True)
class TwoTierCosts:
    """What a two-tier plan costs: every save stalls training `local_write_s`; every K-th save is also persisted to
    the durable tier from the local tier's files, which costs training `persist_s` (0: entirely in the background).
    A failure the local tier survives (process crash, software fault; rate 1/local_mttf_s) costs `local_restart_s`
    (downtime + startup + restore from the local tier); one it does not survive (node loss; 1/node_mttf_s) costs
    `durable_restart_s` (downtime + startup + restore from the durable tier) and the work since the last persist.
    A failure class that never happens has an infinite MTTF."""

    local_write_s: float
    persist_s: float
    local_restart_s: float
    durable_restart_s: float
    local_mttf_s: float
    node_mttf_s: float

    def __post_init__(self) -> None:
        for name in ("local_write_s", "persist_s", "local_restart_s", "durable_restart_s"):
            check_seconds(name, getattr(self, name))
        for name in ("local_mttf_s", "node_mttf_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be a positive number of seconds (inf: never), got {value!r}")

    @property
    def rates(self) -> tuple[float, float]:
        """(lambda_l, lambda_n): failures per second the local tier survives, and node losses."""
        return 1.0 / self.local_mttf_s, 1.0 / self.node_mttf_s

    def single_tier(self) -> tuple[float, float, float]:
        """(write_s, restart_s, mttf_s) of the one-tier plan that saves every checkpoint to the durable tier: each
        save costs the local stall plus the persist, and every failure restores from the durable tier."""
        lam_l, lam_n = self.rates
        return self.local_write_s + self.persist_s, self.durable_restart_s, 1.0 / (lam_l + lam_n)


def _check_plan(interval_s: float, persist_every: int) -> None:
    """A ValueError naming a plan's bad interval or K."""
    check_seconds("interval", interval_s, positive=True)
    if isinstance(persist_every, bool) or not isinstance(persist_every, int) or persist_every < 1:
        raise ValueError(f"persist_every must be a positive integer, got {persist_every!r}")


def two_tier_ettr(interval_s: float, persist_every: int, costs: TwoTierCosts) -> float:
    """Exact expected ETTR of saving locally every `interval_s` compute seconds and persisting every
    `persist_every`-th save, for Poisson failures of both classes striking compute, saves and restarts alike
    (docs/goodput.md derives it): ETTR = K T / E_0 with E_0 = (G + N (1 - Pi)) / Pi."""
    _check_plan(interval_s, persist_every)
    c = costs
    k, t = persist_every, interval_s
    lam_l, lam_n = c.rates
    lam = lam_l + lam_n
    if lam == 0.0:
        return k * t / (k * (t + c.local_write_s) + c.persist_s)
    p_l, p_n = lam_l / lam, lam_n / lam
    try:
        miss = -math.expm1(-lam * c.local_restart_s)  # a local restart is hit by a failure
        leave = 1.0 - miss + miss * p_n  # ... it ends: done, or a node loss turns it into a durable restart
        done = (1.0 - miss) / leave
        local_restart = miss / lam / leave  # expected seconds in a local restart until it ends
        durable_restart = math.expm1(lam * c.durable_restart_s) / lam  # redone until one completes

        def segment(length: float) -> tuple[float, float]:
            """(g, 1 - pi): expected seconds spent on a segment until it completes or a node loss resets the cycle,
            and the chance of the reset (computed without cancellation, so tiny rates stay exact)."""
            hit = -math.expm1(-lam * length)
            a = 1.0 - hit * p_l * done
            return (hit / lam + hit * p_l * local_restart) / a, hit * p_n * (1.0 + p_l * miss / leave) / a

        g, reset = segment(t + c.local_write_s)
        g_last, reset_last = segment(t + c.local_write_s + c.persist_s)
        if reset_last >= 1.0 or (k > 1 and reset >= 1.0):
            return 0.0  # a node loss always comes first: no cycle ever completes
        n = k - 1
        log_pi = math.log1p(-reset) if n else 0.0
        geometric = n if reset == 0.0 else -math.expm1(n * log_pi) / reset  # sum of pi^j for j < K - 1
        big_g = g * geometric + g_last * math.exp(n * log_pi)
        log_big_pi = n * log_pi + math.log1p(-reset_last)
        big_pi = math.exp(log_big_pi)  # the chance a cycle completes before a node loss resets it
        if big_pi == 0.0:
            return 0.0
        e0 = (big_g - durable_restart * math.expm1(log_big_pi)) / big_pi
    except OverflowError:  # failures come so much faster than anything completes that nothing ever does
        return 0.0
    return k * t / e0 if math.isfinite(e0) else 0.0


MAX_PERSIST_EVERY = 10_000  # optimal_two_tier(): the largest K it considers (without node losses K grows unbounded)


def _golden_max(f: Callable[[float], float], lo: float, hi: float, iterations: int = 90) -> tuple[float, float]:
    """(x, f(x)) maximising a unimodal f on [lo, hi], searched on a log scale (golden section)."""
    a, b = math.log(lo), math.log(hi)
    inv = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - inv * (b - a), a + inv * (b - a)
    f1, f2 = f(math.exp(x1)), f(math.exp(x2))
    for _ in range(iterations):
        if f1 < f2:
            a, x1, f1 = x1, x2, f2
            x2 = a + inv * (b - a)
            f2 = f(math.exp(x2))
        else:
            b, x2, f2 = x2, x1, f1
            x1 = b - inv * (b - a)
            f1 = f(math.exp(x1))
    return max((f(lo), lo), (f(hi), hi), (f1, math.exp(x1)), (f2, math.exp(x2)), key=lambda p: p[0])[::-1]


def _interval_bounds(mttf_s: float, min_interval_s: float) -> tuple[float, float]:
    """Where an optimal interval can lie: from one step (or a nanosecond of MTTF) to four MTTFs."""
    check_seconds("min_interval", min_interval_s)
    lo = max(min_interval_s, mttf_s * 1e-9)
    return lo, max(lo, 4.0 * mttf_s)


def best_single_interval(
    write_s: float, restart_s: float, mttf_s: float, *, min_interval_s: float = 0.0
) -> tuple[float, float]:
    """(interval, ETTR): the argmax of the exact one-tier form `expected_ettr` (Daly's formula approximates it)."""
    lo, hi = _interval_bounds(mttf_s, min_interval_s)
    return _golden_max(lambda t: expected_ettr(t, write_s, restart_s, mttf_s), lo, hi)


@dataclass(frozen=True)
class TwoTierPlan:
    """The best (local interval, K) for a TwoTierCosts, its expected ETTR, and the best one-tier plan beside it."""

    interval_s: float
    persist_every: int
    ettr: float
    single_interval_s: float
    single_ettr: float

    @property
    def durable_interval_s(self) -> float:
        """Compute seconds between persists."""
        return self.interval_s * self.persist_every

    @property
    def gain(self) -> float:
        """Expected ETTR gained over the best one-tier plan."""
        return self.ettr - self.single_ettr


def optimal_two_tier(costs: TwoTierCosts, *, min_interval_s: float = 0.0) -> TwoTierPlan:
    """Maximise `two_tier_ettr` over the local interval (continuous, at least `min_interval_s`) and K (an integer
    from 1 to MAX_PERSIST_EVERY): golden section in the interval for each K, ternary search over K."""
    lam_l, lam_n = costs.rates
    if lam_l + lam_n == 0.0:
        raise ValueError(
            "no failures (both MTTFs infinite): every checkpoint only costs time, there is no optimal interval"
        )
    lo, hi = _interval_bounds(1.0 / (lam_l + lam_n), min_interval_s)
    memo: dict[int, tuple[float, float]] = {}

    def best(k: int) -> tuple[float, float]:
        if k not in memo:
            memo[k] = _golden_max(lambda t: two_tier_ettr(t, k, costs), lo, hi)
        return memo[k]

    a, b = 1, MAX_PERSIST_EVERY
    while b - a > 2:
        m1, m2 = a + (b - a) // 3, b - (b - a) // 3
        if best(m1)[1] < best(m2)[1]:
            a = m1 + 1
        else:
            b = m2
    k = max(range(a, b + 1), key=lambda k: best(k)[1])
    t, ettr = best(k)
    single_t, single = best_single_interval(*costs.single_tier(), min_interval_s=lo)
    return TwoTierPlan(t, k, ettr, single_t, single)


def simulate_two_tier(
    interval_s: float, persist_every: int, costs: TwoTierCosts, *, cycles: int = 40_000, seed: int = 0
) -> SimResult:
    """Monte Carlo of the two-tier process, one durable cycle (K segments of compute + local save, the last one
    persisted) at a time: failures of each class are drawn from their own exponential clocks; a local-class failure
    redoes the segment after a local restart, a node loss the whole cycle after a durable restart; failures strike
    restarts too (a node loss turns a local restart into a durable one). `segments` in the result counts cycles.

    A ValueError instead of a run that would not finish (see `simulate`)."""
    _check_plan(interval_s, persist_every)
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    c, k = costs, persist_every
    lam_l, lam_n = c.rates
    lam = lam_l + lam_n
    seg, last = interval_s + c.local_write_s, interval_s + c.local_write_s + c.persist_s
    expected = two_tier_ettr(interval_s, k, c)
    longest = max(last, c.local_restart_s, c.durable_restart_s)
    draws = cycles * (k + lam * k * interval_s / expected) if expected > 0 else math.inf
    if lam * longest > math.log(MAX_TRIES) or draws > MAX_DRAWS:
        raise ValueError(
            f"not simulated: {cycles} cycles of {k} segments of {seg:g} s (restarts {c.local_restart_s:g} s local, "
            f"{c.durable_restart_s:g} s durable; MTTF {c.local_mttf_s:g} s local, {c.node_mttf_s:g} s node): the "
            f"longest of them succeeds once in ~{math.exp(min(lam * longest, 700)):.3g} tries and all cycles "
            f"would need ~{draws:.3g} random draws (exact expected ETTR {expected:.3g})"
        )
    rng = np.random.default_rng(seed)
    wall = np.zeros(cycles)
    idx = np.arange(cycles)
    seg_no = np.zeros(cycles, dtype=np.int64)
    phase = np.zeros(cycles, dtype=np.int8)  # 0: computing segment seg_no, 1: local restart, 2: durable restart
    failures = 0
    while idx.size:
        n = idx.size
        x_l = rng.exponential(c.local_mttf_s, n) if lam_l else np.full(n, np.inf)
        x_n = rng.exponential(c.node_mttf_s, n) if lam_n else np.full(n, np.inf)
        x, node = np.minimum(x_l, x_n), x_n < x_l
        length = np.where(
            phase == 0,
            np.where(seg_no == k - 1, last, seg),
            np.where(phase == 1, c.local_restart_s, c.durable_restart_s),
        )
        ok = x >= length
        wall[idx] += np.where(ok, length, x)
        seg_no = np.where(ok & (phase == 0), seg_no + 1, seg_no)
        failed = ~ok
        failures += int(failed.sum())
        phase = np.where(ok, 0, np.where(node, 2, np.where(phase == 2, 2, 1))).astype(np.int8)
        seg_no = np.where(failed & node, 0, seg_no)
        going = (phase != 0) | (seg_no < k)
        idx, seg_no, phase = idx[going], seg_no[going], phase[going]
    mean = wall.mean()
    ettr = k * interval_s / mean
    return SimResult(float(ettr), float(ettr * wall.std() / mean / math.sqrt(cycles)), failures, cycles)


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
    two_tier: TwoTierAdvice | None = None

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
        if self.two_tier is not None:
            lines += ["", self.two_tier.text()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the gain and the two-tier advice (its plan's derived intervals too)."""
        out = {k: v for k, v in self.__dict__.items() if k != "two_tier"}
        out["gain"] = self.gain
        out["two_tier"] = self.two_tier.to_dict() if self.two_tier is not None else None
        return out


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
    blocking save; a persist costs nothing unless given (it runs in the background). Each class's MTTF: the job's
    failure rate (1/`mttf_s` if given) split by the classified failures' shares; a class never seen gets the running
    time (a lower bound).
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
    put("local_write_s", inputs.local_write_s, _mean([us / 1e6 for us in a.save_us]), "ledger: mean blocking save")
    put("persist_s", inputs.persist_s, 0.0, "default: in the background, free to training")

    def restores(tiers: tuple[str | None, ...]) -> tuple[list[float], str]:
        found = [at.restore_us / 1e6 for at in a.attempts if at.restored_step is not None and at.restored_tier in tiers]
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
        overhead = values["restart_overhead_s"]
        costs = TwoTierCosts(
            values["local_write_s"],
            values["persist_s"],
            overhead + values["local_read_s"],
            overhead + values["durable_read_s"],
            values["local_mttf_s"],
            values["node_mttf_s"],
        )
        plan = optimal_two_tier(costs, min_interval_s=_step_seconds(a) or 0.0)
    return TwoTierAdvice(values, sources, classes, missing, costs, plan, _step_seconds(a))


def _step_seconds(a: Attribution) -> float | None:
    """Mean compute seconds per step run (productive or lost), None without steps."""
    n_steps = sum(at.steps for at in a.attempts)
    return (a.micros["productive"] + a.micros["lost"]) / 1e6 / n_steps if n_steps else None


def advise(attribution: Attribution, *, mttf_s: float | None = None, two_tier: TwoTierInputs | None = None) -> Advice:
    """Fit T_write, T_read, startup and MTTF from the job's own attribution and recommend a checkpoint interval.

    Without failures the MTTF is only a lower bound (the running time); pass `mttf_s` (e.g. mttf_from_rate) then.
    With `two_tier` (overrides, possibly all None) the advice also holds a two-tier plan (`advise_two_tier`).
    """
    if mttf_s is not None:
        check_seconds("mttf", mttf_s, positive=True)
    given_mttf = mttf_s
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
    step_s = _step_seconds(a)
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
        two_tier=advise_two_tier(a, two_tier, mttf_s=given_mttf) if two_tier is not None else None,
    )
