"""A Monte Carlo simulator of a job's failures and checkpoints: the check on the formulas (`ettr.formulas`).

Same names as the formulas: `interval_s`, `write_s`, `restart_s`, `mttf_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .formulas import TwoTierCosts, check_plan, check_seconds, expected_ettr, two_tier_ettr

MAX_TRIES = 1e4  # simulate(): expected tries per segment (or per restart) beyond which it would not finish


MAX_DRAWS = 1e8  # simulate(): expected random draws in all (about a second of numpy)


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
    if segments < 2:  # one segment's wall time has no spread to measure: its standard error read 0
        raise ValueError(f"segments must be at least 2 (one gives no standard error), got {segments}")
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


def simulate_two_tier(
    interval_s: float, persist_every: int, costs: TwoTierCosts, *, cycles: int = 40_000, seed: int = 0
) -> SimResult:
    """Monte Carlo of the two-tier process, one durable cycle (K segments of compute + local save, the last one
    persisted) at a time: failures of each class are drawn from their own exponential clocks; a local-class failure
    redoes the segment after a local restart, a node loss the whole cycle after a durable restart; failures strike
    restarts too (a node loss turns a local restart into a durable one). `segments` in the result counts cycles.

    A ValueError instead of a run that would not finish (see `simulate`)."""
    check_plan(interval_s, persist_every)
    if cycles < 2:
        raise ValueError(f"cycles must be at least 2 (one gives no standard error), got {cycles}")
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
