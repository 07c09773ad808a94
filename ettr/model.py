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

        def segment(length: float) -> tuple[float, float, float]:
            """(g, pi, 1 - pi): expected seconds spent on a segment before it completes or a node loss resets the
            cycle, the chance it completes first, and its complement (computed without cancellation)."""
            hit = -math.expm1(-lam * length)
            a = 1.0 - hit * p_l * done
            reset = hit * p_n * (1.0 + p_l * miss / leave) / a
            return (hit / lam + hit * p_l * local_restart) / a, (1.0 - hit) / a, reset

        g, pi, reset = segment(t + c.local_write_s)
        g_last, pi_last, reset_last = segment(t + c.local_write_s + c.persist_s)
        log_pi = math.log1p(-reset) if reset < 1.0 else -math.inf
        geometric = (k - 1) if reset == 0.0 else -math.expm1((k - 1) * log_pi) / reset if k > 1 else 0.0
        big_g = g * geometric + g_last * math.exp((k - 1) * log_pi if k > 1 else 0.0)
        log_big_pi = ((k - 1) * log_pi if k > 1 else 0.0) + (math.log1p(-reset_last) if reset_last < 1 else -math.inf)
        big_pi = math.exp(log_big_pi)  # the chance a cycle completes before a node loss resets it
        if big_pi == 0.0:
            return 0.0
        e0 = (big_g - durable_restart * math.expm1(log_big_pi)) / big_pi
    except OverflowError:  # failures come so much faster than anything completes that nothing ever does
        return 0.0
    return k * t / e0 if math.isfinite(e0) else 0.0


MAX_PERSIST_EVERY = 10_000  # optimal_two_tier(): the largest K it considers (without node losses K grows unbounded)


def _golden_max(f, lo: float, hi: float, iterations: int = 90) -> tuple[float, float]:
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


def best_single_interval(write_s: float, restart_s: float, mttf_s: float, *, min_interval_s: float = 0.0):
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
        raise ValueError("no failures (both MTTFs infinite): any interval is optimal, checkpoints only cost time")
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
    single_t, single = best_single_interval(*costs.single_tier()[:2], costs.single_tier()[2], min_interval_s=lo)
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
            f"{c.durable_restart_s:g} s durable) would need ~{draws:.3g} random draws "
            f"(exact expected ETTR {expected:.3g})"
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
