"""The model's closed forms against published reference points and against the Monte Carlo simulator."""

from __future__ import annotations

import itertools

import pytest

from ettr import (
    FakeClock,
    GoodputTracker,
    advise,
    attribute_root,
    cluster_ettr,
    daly_interval,
    expected_ettr,
    mttf_from_rate,
    seed_ettr,
    simulate,
    young_interval,
)

# Meta, 16,384 GPUs = 2048 nodes, 6.5 failures per 1000 node-days, u0 = 5 min restart overhead, write cost 0.
NODES, RATE, U0 = 2048, 6.5e-3, 300.0


def test_reference_points():
    assert mttf_from_rate(NODES, RATE) / 3600 == pytest.approx(1.80, abs=0.01)
    assert cluster_ettr(5 * 60, NODES, RATE, U0) == pytest.approx(0.93, abs=0.005)
    assert cluster_ettr(60 * 60, NODES, RATE, U0) == pytest.approx(0.68, abs=0.005)
    # the seed model with T_read = u0 is the same first-order expression
    m = mttf_from_rate(NODES, RATE)
    assert seed_ettr(300, 0, U0, m) == pytest.approx(cluster_ettr(300, NODES, RATE, U0))


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


def test_advise_fits_costs_from_ledger(tmp_path):
    clock = FakeClock(0.0)
    for k in range(3):  # three attempts, two failures, 40 steps of 10 s, saves of 4 s every 10 steps
        clock.set(1000.0 * k)
        tr = GoodputTracker(str(tmp_path), attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=0).start()
        clock.advance(20.0)
        with tr.span("checkpoint_restore"):
            clock.advance(6.0)
        tr.checkpoint_restored(10 * k or None)
        for s in range(10 * k + 1, 10 * k + 41):
            with tr.step(s):
                clock.advance(10.0)
            if s % 10 == 0:
                with tr.span("checkpoint_save", step=s):
                    clock.advance(4.0)
                tr.checkpoint_committed(s, 1.0)
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
