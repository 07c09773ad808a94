"""The model's closed forms against published reference points and against the Monte Carlo simulator."""

from __future__ import annotations

import itertools
import json
import math

import pytest

import ettr.cli
from ettr import (
    FakeClock,
    GoodputTracker,
    TwoTierCosts,
    advise,
    attribute_root,
    best_single_interval,
    cluster_ettr,
    daly_interval,
    expected_ettr,
    mttf_from_rate,
    optimal_two_tier,
    seed_ettr,
    simulate,
    simulate_two_tier,
    two_tier_ettr,
    young_interval,
)
from ettr.formulas import MAX_SECONDS

# Meta, 16,384 GPUs = 2048 nodes, 6.5 failures per 1000 node-days, u0 = 5 min restart overhead, write cost 0.
NODES, RATE, U0 = 2048, 6.5e-3, 300.0


def test_reference_points():
    assert mttf_from_rate(NODES, RATE) / 3600 == pytest.approx(1.80, abs=0.01)
    assert cluster_ettr(5 * 60, NODES, RATE, U0) == pytest.approx(0.93, abs=0.005)
    assert cluster_ettr(60 * 60, NODES, RATE, U0) == pytest.approx(0.68, abs=0.005)
    # the seed model with T_read = u0 is the same first-order expression
    m = mttf_from_rate(NODES, RATE)
    assert seed_ettr(300, 0, U0, m) == pytest.approx(cluster_ettr(300, NODES, RATE, U0))


def test_first_order_forms_are_never_negative(capsys):
    """A save ten times the interval: the seed form said -9.05 (`simulate`'s `seed_model`), the cluster form at a
    day's interval -5.8; an ETTR is in [0, 1], so they give 0 there, where the exact form still holds."""
    assert seed_ettr(100, 1000, 0, 1000) == 0.0
    assert cluster_ettr(86_400, NODES, RATE, U0) == 0.0
    argv = ["simulate", "--interval", "100", "--mttf", "1000", "--write", "1000", "--restart", "0", "--json"]
    assert ettr.cli.main([*argv, "--segments", "1000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed_model"] == 0.0 and out["expected_exact"] == pytest.approx(0.0499, abs=1e-4)


def test_simulator_at_reference_points():
    m = mttf_from_rate(NODES, RATE)
    short = simulate(300, 0, U0, m)
    assert short.ettr == pytest.approx(cluster_ettr(300, NODES, RATE, U0), rel=0.01)
    assert short.ettr == pytest.approx(expected_ettr(300, 0, U0, m), rel=0.01)
    # At 60 min a failure per interval is likely; first order (0.676) is pessimistic, the exact form (0.714) holds.
    long = simulate(3600, 0, U0, m)
    assert long.ettr == pytest.approx(expected_ettr(3600, 0, U0, m), rel=0.01)
    assert long.ettr > cluster_ettr(3600, NODES, RATE, U0) + 0.02


GRID = list(itertools.product((6490.0, 20_000.0, 100_000.0), (300.0, 600.0, 1200.0), (0.0, 5.0, 15.0), (60.0, 300.0)))


@pytest.mark.parametrize("mttf,interval,write,restart", GRID)
def test_simulator_agrees_with_closed_forms(mttf, interval, write, restart):
    sim = simulate(interval, write, restart, mttf, segments=100_000, seed=int(mttf + interval + write + restart))
    assert sim.ettr == pytest.approx(expected_ettr(interval, write, restart, mttf), rel=0.01)
    if interval + restart <= 0.1 * mttf and write <= 0.05 * interval:  # where first-order forms are meant to hold
        assert sim.ettr == pytest.approx(seed_ettr(interval, write, restart, mttf), rel=0.01)
        n_nodes = 1000
        rate = 86_400.0 / mttf / n_nodes
        assert sim.ettr == pytest.approx(cluster_ettr(interval, n_nodes, rate, restart, write), rel=0.01)


def test_optimal_intervals():
    assert young_interval(60, 20_000) == pytest.approx(1549.19, abs=0.01)
    # Daly's optimum is the argmax of the exact form, Young's is close for small write costs
    grid = [t / 10 for t in range(1000, 40_000)]
    best = max(grid, key=lambda t: expected_ettr(t, 60, 300, 20_000))
    assert daly_interval(60, 20_000) == pytest.approx(best, rel=0.01)
    assert daly_interval(60, 20_000) == pytest.approx(young_interval(60, 20_000), rel=0.05)
    assert daly_interval(50_000, 20_000) == 20_000


def _train(tr: GoodputTracker, clock: FakeClock, steps: range) -> None:
    """`steps` of 10 s each, a 4 s save committed after every 10th."""
    for s in steps:
        with tr.step(s):
            clock.advance(10.0)
        if s % 10 == 0:
            with tr.span("checkpoint_save", step=s):
                clock.advance(4.0)
            tr.checkpoint_committed(s, 1.0)


def test_advise_fits_costs_from_ledger(tmp_path):
    clock = FakeClock(0.0)
    for k in range(3):  # three attempts, two failures, 40 steps of 10 s, saves of 4 s every 10 steps
        clock.set(1000.0 * k)
        tr = GoodputTracker(str(tmp_path), attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=0).start()
        clock.advance(20.0)
        with tr.span("checkpoint_restore"):
            clock.advance(6.0)
        tr.checkpoint_restored(10 * k or None)
        _train(tr, clock, range(10 * k + 1, 10 * k + 41))
        if k == 2:
            tr.end()
    adv = advise(attribute_root(str(tmp_path)))
    assert (adv.write_s, adv.read_s, adv.startup_s, adv.step_s) == pytest.approx((4.0, 6.0, 20.0, 10.0))
    assert adv.mttf_failures == 2
    # an attempt lasts 20 + 6 + 40 * 10 + 4 * 4 = 442 s; each failure: downtime 558 + startup 20 + restore 6
    assert adv.restart_s == pytest.approx(584.0)
    assert adv.interval_s == pytest.approx(100.0)
    assert adv.recommended_interval_s == pytest.approx(daly_interval(4.0, adv.mttf_s))
    assert adv.gain > 0 and "rests on 2 failure(s)" in adv.text()
    # a given MTTF rests on none of them: it said "(given; rests on 2 failure(s))"
    given = advise(attribute_root(str(tmp_path)), mttf_s=7200.0)
    assert given.mttf_failures == 2 and "MTTF 2.000 h (given; the ledger shows 2 failure(s))" in given.text()


def test_advise_when_every_save_came_before_any_step_says_the_interval_is_unknown(tmp_path, capsys):
    """One save of step 0 before training (an initial checkpoint), then 9 steps: no compute ended in a save, so the
    current interval is not measured (None). advise's text, and report's, failed on it with a TypeError traceback
    ('>=' between NoneType and int); they now say so and still recommend an interval."""
    clock = FakeClock(0.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a0", rank=0, clock=clock, flush_interval=0).start()
    with tr.span("checkpoint_save", step=0):
        clock.advance(4.0)
    tr.checkpoint_committed(0, 1.0)
    _train(tr, clock, range(1, 10))
    tr.end()
    adv = advise(attribute_root(str(tmp_path)), mttf_s=3600.0)
    assert (adv.interval_s, adv.expected_ettr_current, adv.gain, adv.too_short) == (None, None, None, None)
    assert "current interval: not measured, no compute came before a save" in adv.text()
    assert f"recommended interval {adv.recommended_interval_s:.1f} s" in adv.text()
    for command in ("advise", "report"):
        assert ettr.cli.main([command, str(tmp_path), "--mttf", "3600"]) == 0
        assert "current interval: not measured" in capsys.readouterr().out


def test_the_current_interval_is_the_compute_before_each_save_not_the_work_a_failure_lost(tmp_path):
    """Saves every 10 steps of 10 s: attempt 1 dies 5 steps after its save at step 20 (50 s lost), attempt 2
    resumes there, saves at 30 and 40 and runs 3 steps more. The interval is 100 s; compute / saves said 120."""
    clock = FakeClock(0.0)
    for k, (first, last) in enumerate(((1, 25), (21, 43))):
        clock.set(1000.0 * k)
        tr = GoodputTracker(str(tmp_path), attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=0).start()
        tr.checkpoint_restored(first - 1 or None)
        _train(tr, clock, range(first, last + 1))
    tr.end()
    a = attribute_root(str(tmp_path))
    assert (a.saves, a.micros["lost"], a.micros["productive"]) == (4, 50_000_000, 430_000_000)
    adv = advise(a, mttf_s=3600.0)
    assert adv.interval_s == pytest.approx(100.0)
    assert adv.expected_ettr_current == pytest.approx(expected_ettr(100.0, 4.0, adv.restart_s, 3600.0))


def test_huge_and_degenerate_inputs_give_a_number_or_a_clear_error(tmp_path):
    """An MTTF far beyond the segment: expected_ettr tends to T / (T + d) (it returned 0.0, M e^{R/M} overflowing);
    durations past MAX_SECONDS are refused naming the argument (simulate printed inf intervals); a ledger whose
    steps hold no compute time is too short to advise (advise raised a TypeError)."""
    assert expected_ettr(600, 10, 60, 1e10) == pytest.approx(600 / 610, rel=1e-6)
    assert expected_ettr(600, 10, 1e308, 1e308) == pytest.approx(600 / 610 / math.e, rel=1e-6)
    with pytest.raises(ValueError, match=r"mttf must be a finite positive number of seconds, at most 1e\+10"):
        simulate(600, 10, 60, 1.7e308)
    clock = FakeClock(0.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a", rank=0, clock=clock).start()
    for s in (1, 2):
        with tr.step(s):
            pass  # all its time elsewhere
        clock.advance(1.0)
    with tr.span("checkpoint_save", step=2):
        clock.advance(0.5)
    tr.checkpoint_committed(2, 0.0)
    tr.end()
    adv = advise(attribute_root(str(tmp_path)), mttf_s=3600)
    assert adv.too_short == "its 2 step(s) hold no compute time (productive and lost: 0 s); a fit needs some"
    assert adv.interval_s is None and "run too short" in adv.text()


# -- two tiers -----------------------------------------------------------------------------------------------------


def test_two_tier_model_reduces_to_the_one_tier_form():
    inf = float("inf")
    # one failure class, persisting every save: the exact one-tier form with that class's restart cost
    assert two_tier_ettr(600, 1, TwoTierCosts(5, 0, 60, 900, 14_400, inf)) == pytest.approx(
        expected_ettr(600, 5, 60, 14_400), rel=1e-12
    )
    assert two_tier_ettr(600, 1, TwoTierCosts(5, 20, 60, 900, inf, 14_400)) == pytest.approx(
        expected_ettr(600, 25, 900, 14_400), rel=1e-12
    )
    # both classes with equal restarts and persisting every save: one class of the summed rate
    assert two_tier_ettr(600, 1, TwoTierCosts(5, 0, 300, 300, 7_200, 21_600)) == pytest.approx(
        expected_ettr(600, 5, 300, 5_400), rel=1e-12
    )
    # no failures at all: only the saves cost
    assert two_tier_ettr(600, 4, TwoTierCosts(5, 20, 60, 900, inf, inf)) == pytest.approx(2400 / (4 * 605 + 20))


TWO_TIER_GRID = list(
    itertools.product(
        ((3_600.0, 86_400.0), (14_400.0, 14_400.0), (7_200.0, 43_200.0)), (300.0, 1200.0), (1, 5, 20), (0.0, 60.0)
    )
)


@pytest.mark.parametrize("mttfs,interval,k,persist", TWO_TIER_GRID)
def test_two_tier_simulator_agrees_with_the_closed_form(mttfs, interval, k, persist):
    costs = TwoTierCosts(5.0, persist, 60.0, 600.0, *mttfs)
    model = two_tier_ettr(interval, k, costs)
    sim = simulate_two_tier(interval, k, costs, cycles=max(20_000, 100_000 // k), seed=k + int(interval + persist))
    assert abs(sim.ettr - model) / model <= 0.01
    assert abs(sim.ettr - model) <= 4 * sim.stderr  # and within the simulation's own noise


def test_optimal_pair_is_the_argmax_and_follows_young_per_tier():
    costs = TwoTierCosts(5.0, 20.0, 60.0, 600.0, 14_400.0, 86_400.0)
    plan = optimal_two_tier(costs)
    brute = max((two_tier_ettr(t, k, costs), t, k) for k in range(1, 30) for t in range(100, 2000, 5))
    assert plan.persist_every == brute[2] == 5
    assert plan.ettr >= brute[0] and plan.interval_s == pytest.approx(brute[1], abs=5)
    # first order: the local interval is Young's on local failures, the durable one Young's on node losses
    assert plan.interval_s == pytest.approx(young_interval(5.0, 14_400.0), rel=0.05)
    assert plan.durable_interval_s == pytest.approx(young_interval(20.0, 86_400.0), rel=0.05)
    single_t, single = best_single_interval(25.0, 600.0, 1 / (1 / 14_400 + 1 / 86_400))
    assert (plan.single_interval_s, plan.single_ettr) == (single_t, single)
    assert plan.gain == plan.ettr - single > 0.04


def test_mttfs_as_long_as_a_duration_may_be_get_a_plan(capsys):
    """MTTFs of MAX_SECONDS (1e10 s) are valid: the interval search stops at MAX_SECONDS, where its bound of four
    combined MTTFs (2e10 s) was refused as an 'interval' the user never gave (`simulate` and `advise` exited 2)."""
    plan = optimal_two_tier(TwoTierCosts(1.0, 0.0, 300.0, 300.0, MAX_SECONDS, MAX_SECONDS))
    assert plan.interval_s == pytest.approx(young_interval(1.0, MAX_SECONDS / 2), rel=0.01)
    slow = optimal_two_tier(TwoTierCosts(1e9, 0.0, 300.0, 300.0, MAX_SECONDS, MAX_SECONDS))
    assert 0 < slow.interval_s <= MAX_SECONDS and 0 < slow.single_interval_s <= MAX_SECONDS
    argv = ["simulate", "--interval", "600", "--write", "1", "--local-mttf", "1e10", "--node-mttf", "1e10", "--json"]
    assert ettr.cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["optimal_interval"] == pytest.approx(plan.interval_s)


LOCAL_DOMINATES = list(
    itertools.product(
        ((3_600.0, 86_400.0), (7_200.0, 21_600.0), (1_800.0, 43_200.0)),  # local-class failures 3-24x as frequent
        ((5.0, 0.0), (1.0, 30.0), (10.0, 120.0)),  # (local stall, persist cost)
        ((30.0, 300.0), (120.0, 120.0), (60.0, 1_800.0)),  # (local restart, durable restart)
    )
)


@pytest.mark.parametrize("mttfs,writes,restarts", LOCAL_DOMINATES)
def test_advised_pair_beats_the_best_single_tier_interval_in_the_simulator(mttfs, writes, restarts):
    costs = TwoTierCosts(*writes, *restarts, *mttfs)
    plan = optimal_two_tier(costs)
    if writes[1] == 0 and restarts[0] == restarts[1]:  # tiers that cost the same: the plans are one and the same
        assert plan.persist_every == 1 and plan.interval_s == pytest.approx(plan.single_interval_s, rel=1e-6)
        assert plan.gain == pytest.approx(0.0, abs=1e-12)
        return
    two = simulate_two_tier(plan.interval_s, plan.persist_every, costs, cycles=20_000, seed=1)
    write, restart, mttf = costs.single_tier()
    one = simulate(plan.single_interval_s, write, restart, mttf, segments=100_000, seed=2)
    assert two.ettr - one.ettr > 4 * math.hypot(two.stderr, one.stderr), (plan, two, one)


def test_two_tier_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="persist_s must be a finite non-negative number of seconds, .* got -1"):
        TwoTierCosts(5, -1, 60, 600, 3600, 3600)
    with pytest.raises(ValueError, match="node_mttf_s must be a positive number of seconds .* got 0"):
        TwoTierCosts(5, 1, 60, 600, 3600, 0)
    costs = TwoTierCosts(5, 1, 60, 600, 3600, 3600)
    with pytest.raises(ValueError, match="persist_every must be a positive integer, got 0"):
        two_tier_ettr(600, 0, costs)
    with pytest.raises(ValueError, match="not simulated"):
        simulate_two_tier(600, 1, TwoTierCosts(5, 1, 60, 600, 60, 60))
