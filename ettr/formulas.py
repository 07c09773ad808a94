"""Expected-ETTR formulas and the checkpoint intervals that maximise them (one tier, and two tiers with K).

Throughout: `interval_s` is compute time between checkpoints, `write_s` the blocking cost of one save, `restart_s`
the cost of one failure besides lost work (downtime + startup + restore), `mttf_s` the job's mean time to failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

NODE_DAY_S = 86_400.0


# The most seconds any duration may be (317 years): a window, an interval, an MTTF. Past it microsecond counts and the
# formulas overflow (a window of 1e308 s failed at the tracker's first flush, inside the training loop).
MAX_SECONDS = 1e10


def check_seconds(name: str, value: float, *, positive: bool = False) -> float:
    """`value` if it is a non-negative (or positive) number of seconds, at most MAX_SECONDS; else a ValueError naming
    it (NaN and inf fail the comparisons; an int of any size is compared exactly; a bool is no number of seconds)."""
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (0 < value if positive else 0 <= value)
        and value <= MAX_SECONDS
    ):
        raise ValueError(
            f"{name} must be a finite {'positive' if positive else 'non-negative'} number of seconds, at most "
            f"{MAX_SECONDS:g} (317 years), got {value!r}"
        )
    return float(value)


def check_window(name: str, window_s: float) -> float:
    """`window_s` if it is a positive number of seconds of at least a microsecond (the ledgers' resolution: a
    shorter window held no time, an ETTR of 0); else a ValueError naming `name`."""
    check_seconds(name, window_s, positive=True)
    if window_s < 1e-6:
        raise ValueError(f"{name} must be at least 1e-06 s (a microsecond, the ledgers' resolution), got {window_s!r}")
    return float(window_s)


def seed_ettr(interval_s: float, write_s: float, read_s: float, mttf_s: float) -> float:
    """First-order model: ETTR = 1 - T_read/MTTF - T_write/T_period - T_period/(2 MTTF), clamped at 0: an ETTR is never
    negative, and losses that large are outside the first order's validity (`expected_ettr` holds there)."""
    return max(0.0, 1.0 - read_s / mttf_s - write_s / interval_s - interval_s / (2.0 * mttf_s))


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
    try:  # M (e^{(T+d)/M} - 1) first: it tends to T + d as M grows, where M e^{R/M} alone would overflow to inf
        return interval_s / (math.exp(restart_s / m) * (m * math.expm1((interval_s + write_s) / m)))
    except OverflowError:  # failures come so much faster than a segment completes that nothing ever does
        return 0.0


def cluster_ettr(
    interval_s: float, n_nodes: int, failures_per_node_day: float, restart_s: float, write_s: float = 0.0
) -> float:
    """Cluster form: E[ETTR] = (1 - N r (u0 + T/2)) / (1 + T_write/T), r per node-day, u0 = restart_s; at least 0,
    as `seed_ettr`."""
    rate = n_nodes * failures_per_node_day / NODE_DAY_S
    return max(0.0, (1.0 - rate * (restart_s + interval_s / 2.0)) / (1.0 + write_s / interval_s))


def mttf_from_rate(n_nodes: int, failures_per_node_day: float) -> float:
    """Job MTTF in seconds for N nodes each failing r times per node-day."""
    return NODE_DAY_S / (n_nodes * failures_per_node_day)


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


def check_plan(interval_s: float, persist_every: int) -> None:
    """A ValueError naming a plan's bad interval or K."""
    check_seconds("interval", interval_s, positive=True)
    if isinstance(persist_every, bool) or not isinstance(persist_every, int) or persist_every < 1:
        raise ValueError(f"persist_every must be a positive integer, got {persist_every!r}")


def two_tier_ettr(interval_s: float, persist_every: int, costs: TwoTierCosts) -> float:
    """Exact expected ETTR of saving locally every `interval_s` compute seconds and persisting every
    `persist_every`-th save, for Poisson failures of both classes striking compute, saves and restarts alike
    (docs/goodput.md derives it): ETTR = K T / E_0 with E_0 = (G + N (1 - Pi)) / Pi."""
    check_plan(interval_s, persist_every)
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
    """Where an optimal interval can lie: from one step (or a nanosecond of MTTF) to four MTTFs, within MAX_SECONDS
    (the longest interval a plan may have: an MTTF near it must not yield a bound the plan's check refuses)."""
    check_seconds("min_interval", min_interval_s)
    lo = min(max(min_interval_s, mttf_s * 1e-9), MAX_SECONDS)
    return lo, min(max(lo, 4.0 * mttf_s), MAX_SECONDS)


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
