"""Intervals that retune themselves with two tiers (issue 27, item 4): the pair (local interval, K) refitted from the
run's own ledger, K handed to a real two-tier manager, which persists every K-th save since the last persist."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt import layout
from ckpt.storage import open_storage
from ettr import FakeClock, GoodputTracker, TwoTierCosts, TwoTierInputs, advise, attribute_root, optimal_two_tier
from integrations import TrainLoop, advised_interval, advised_two_tier
from test_ettr_report import TWO_TIER_FIT, two_tier_job
from test_ettr_trust import short_run


def test_the_pair_is_refit_from_the_ledger_once_failures_are_classified(tmp_path):
    # the run so far: one attempt, saves but no failure: no plan, the start schedule stays
    clock = FakeClock(0.0)
    tracker = GoodputTracker(str(tmp_path / "early"), attempt_id="a0", rank=0, clock=clock).start()
    for s in range(1, 7):
        with tracker.step(s):
            clock.advance(10.0)
    with tracker.span("checkpoint_save", step=6):
        clock.advance(2.0)
    tracker.checkpoint_committed(6, 1.0, tier="local")
    tracker.flush()
    assert advised_two_tier(str(tmp_path / "early"))() is None

    # later: a crash the local tier survived and a node loss (tests/test_ettr_report.py works its costs by hand)
    two_tier_job(str(tmp_path / "later"))
    f = TWO_TIER_FIT
    plan = optimal_two_tier(
        TwoTierCosts(2.0, 30.0, 364.0 + 5.0, 364.0 + 50.0, f["local_mttf_s"], f["node_mttf_s"]), min_interval_s=10.0
    )
    advice = advised_two_tier(str(tmp_path / "later"), inputs=TwoTierInputs(persist_s=30.0))()
    assert advice == (plan.interval_s, plan.persist_every) and plan.persist_every > 1
    free = optimal_two_tier(
        TwoTierCosts(2.0, 0.0, 364.0 + 5.0, 364.0 + 50.0, f["local_mttf_s"], f["node_mttf_s"]), min_interval_s=10.0
    )
    assert advised_two_tier(str(tmp_path / "later"))() == (free.interval_s, free.persist_every)  # persists: free


def test_a_refit_grown_slow_is_not_repeated_until_a_hundred_times_its_cost_has_passed(tmp_path):
    """A refit reads and attributes the live attempt's whole ledger in the training thread, ~20 us a step: at 300,000
    steps, seconds at every save. Refits under 50 ms of the thread's CPU are never skipped (a busy machine does not
    make them dearer); after a dearer one, the advice is None (the interval in force stays) until 100x its cost has
    passed, so refits keep to 1% of the time."""
    short_run(str(tmp_path))
    fitted = advise(attribute_root(str(tmp_path)), mttf_s=3600.0).recommended_interval_s
    # the wall clock as each call reads it (before, and after a refit that cost over 50 ms), and the training thread's
    # CPU time before and after each refit: one of 10 ms at 0 s, one of 2 s ending at 3 s (due again at 3 + 200 s),
    # two skipped before 203 s, then refits again
    wall = iter([0.0, 1.0, 3.0, 100.0, 202.99, 203.0, 210.0])
    cpu = iter([0.0, 0.01, 0.01, 2.01, 2.01, 2.02, 2.02, 2.03])
    interval_s = advised_interval(str(tmp_path), mttf_s=3600.0, clock=lambda: next(wall), cpu_clock=lambda: next(cpu))
    assert [interval_s() for _ in range(6)] == [fitted, fitted, None, None, fitted, fitted]
    assert next(wall, "all read") == next(cpu, "all read") == "all read"


def state(step: int) -> dict:
    return {"w": torch.full((8,), float(step))}


def test_the_manager_persists_every_kth_save_since_the_last_and_k_can_change(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=3) as m:
        for s in range(1, 5):  # 3 is the 3rd save
            m.save(s, state(s)).wait()
        m.save(5, state(5), persist=True).wait()  # persisted: the count starts again after it
        m.persist_every = 2  # retuned
        for s in range(6, 10):  # 7 and 9
            m.save(s, state(s)).wait()
        m.wait()
        assert m.persist_every == 2
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match="persist_every must be a positive int"):
                m.persist_every = bad
    assert layout.committed_steps(open_storage(durable)) == [3, 5, 7, 9]
    with ckpt.CheckpointManager(str(tmp_path / "one")) as single:
        assert single.persist_every is None
        with pytest.raises(ValueError, match="needs a local tier"):
            single.persist_every = 2


def test_a_loop_with_advice_and_a_local_tier_hands_the_retuned_k_to_its_manager(tmp_path):
    root = str(tmp_path / "run")
    two_tier_job(root)  # this job's earlier attempts: their ledgers classify one failure of each kind
    local = str(tmp_path / "local")
    assert advised_two_tier(root)()[1] == 1  # persists are free by default: persist every save
    with TrainLoop(
        root, {"w": torch.zeros(4)}, every_steps=2, advise=True, local=local, persist_every=5, rng=False
    ) as loop:
        # the start (a restore of nothing) already refits from the earlier attempts' ledgers: the interval is the
        # plan's (none in seconds before; this attempt's start-up is in the fit too), K goes half way from 5 toward
        # 1, and the manager has it
        assert isinstance(loop.decision, ckpt.AdvisedTiers) and loop.decision.seconds > 10.0
        assert (loop.decision.persist_every, loop.manager.persist_every) == (3, 3)
        for step in loop.steps(4):
            loop.on_step_end(step)
        assert (loop.decision.persist_every, loop.manager.persist_every) == (2, 2)  # the last step's save: refit
