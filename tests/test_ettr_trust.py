"""Numbers an operator can trust (issue 27, item 5): the job attribute is the run id, identity on every point,
retained steps told from deleted ones, one mean restore time, and advice that says when a run is too short."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import ckpt
import integrations
from ettr import (
    FakeClock,
    GoodputTracker,
    TwoTierInputs,
    advise,
    attribute_root,
    configure_metrics,
    daly_interval,
    read_ledgers,
)
from ettr.tracker import JOB_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ettr", *args], capture_output=True, text=True, cwd=REPO)


def points(reader) -> list[tuple[str, dict, object]]:
    data = reader.get_metrics_data()
    return [
        (m.name, dict(p.attributes), p)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    ]


@pytest.fixture
def no_job_env(monkeypatch):
    for var in JOB_ENV:
        monkeypatch.delenv(var, raising=False)


# -- (a) the job attribute defaults to the run id --------------------------------------------------------------


def test_the_job_is_the_launchers_run_id_in_ckpts_order(tmp_path, no_job_env, monkeypatch):
    root = str(tmp_path)
    assert GoodputTracker(root).job_id == root  # nothing names it (yet): the root, until a manager tells its run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default is no id
    assert GoodputTracker(root).job_id == root
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-1")
    assert GoodputTracker(root).job_id == "rdzv-1"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # as ckpt.run: SLURM's id before torchrun's
    assert GoodputTracker(root).job_id == "4242" == ckpt.run.Run.current().id
    monkeypatch.setenv("CKPT_RUN_ID", "run-7")
    assert GoodputTracker(root).job_id == "run-7" == ckpt.run.Run.current().id
    monkeypatch.setenv("ETTR_JOB_ID", "job-9")
    assert GoodputTracker(root).job_id == "job-9"
    assert GoodputTracker(root, job_id="given").job_id == "given"


def test_the_managers_run_id_becomes_the_job_on_every_point(tmp_path, no_job_env):
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=clock, flush_interval=0)
    _, reader = configure_metrics("memory", tracker=tracker, set_global=False)
    tracker.start()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker, run_id="run-42") as m:
        assert tracker.job_id == "run-42"
        assert m.restore({"w": torch.zeros(2)}) is None
        with tracker.step(1):
            clock.advance(1.0)
        m.save(1, {"w": torch.ones(2)}).wait()
    tracker.end()
    seen = points(reader)
    assert seen and {attrs["ettr.job"] for _, attrs, _ in seen} == {"run-42"}
    job_time = {a["ettr.category"]: p.value for n, a, p in seen if n == "ettr.job.time"}
    assert job_time["productive"] == 1.0  # a fake clock: exactly the one step's second
    # a job named by job_id= (or the environment) stays named so
    named = GoodputTracker(str(tmp_path / "b"), job_id="mine", clock=FakeClock(0.0)).start()
    with ckpt.CheckpointManager(tmp_path / "b", tracker=named, run_id="run-43"):
        assert named.job_id == "mine"
    named.end()


def test_a_run_id_told_after_the_first_points_keeps_one_job_series(tmp_path, no_job_env, caplog):
    """A tracker handed to a manager after its first steps (or to a second manager of another run id): relabelling
    the points left the old job's series exported beside the new one, frozen at their last values (the SDK exports
    a series it has for the provider's lifetime): two jobs on every dashboard for one process. The job now stays
    the one the points carry, and a warning names both ids."""
    root = str(tmp_path)
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(root, attempt_id="a1", rank=0, clock=clock, flush_interval=0)
    _, reader = configure_metrics("memory", tracker=tracker, set_global=False)
    tracker.start()
    with tracker.step(1):
        clock.advance(1.0)
    assert {attrs["ettr.job"] for _, attrs, _ in points(reader)} == {root}
    with caplog.at_level("WARNING", logger="ettr"):
        with ckpt.CheckpointManager(tmp_path, tracker=tracker, run_id="run-late") as m:
            with tracker.step(2):
                clock.advance(1.0)
            m.save(2, {"w": torch.ones(2)}).wait()
    tracker.end()
    assert tracker.job_id == root
    (warning,) = [r.getMessage() for r in caplog.records if "run-late" in r.getMessage()]
    assert repr(root) in warning and "job_id=" in warning
    seen = points(reader)
    assert {attrs["ettr.job"] for _, attrs, _ in seen} == {root}
    job_time = {a["ettr.category"]: p.value for n, a, p in seen if n == "ettr.job.time"}
    assert job_time["productive"] == 2.0  # both steps, in the one series


# -- (b) host, service and job on every point ----------------------------------------------------------------------


def test_identity_on_every_point_is_an_option(tmp_path):
    for option in (False, True):
        clock = FakeClock(1000.0)
        tr = GoodputTracker(str(tmp_path / str(option)), job_id="job-5", attempt_id="a1", rank=0, clock=clock)
        _, reader = configure_metrics(
            "memory", tracker=tr, set_global=False, service_name="llm-pretrain", identity_on_points=option
        )
        tr.start()
        clock.advance(2.0)
        with tr.step(1):
            clock.advance(3.0)
        with tr.span("checkpoint_save", step=1):
            clock.advance(0.5)
        tr.checkpoint_committed(1, 1.5, 4096)
        tr.end()
        seen = points(reader)
        names = {n for n, _, _ in seen}
        assert {"ettr.job.time", "ettr.attempt.time", "ettr.ratio", "ettr.checkpoint_save.duration"} <= names
        identity = {"service.name": "llm-pretrain", "host.name": socket.gethostname(), "ettr.job": "job-5"}
        for name, attrs, _ in seen:
            on_point = {k: attrs[k] for k in identity if k in attrs}
            assert on_point == (identity if option else {"ettr.job": "job-5"}), (name, attrs)
        job_time = {a["ettr.category"]: p.value for n, a, p in seen if n == "ettr.job.time"}
        assert job_time == {"startup": 2.0, "productive": 3.0, "checkpoint_save": 0.5}


# -- (c) retained steps told from deleted ones -------------------------------------------------------------------


def test_report_tells_retained_steps_from_deleted_ones(tmp_path):
    tracker = GoodputTracker(str(tmp_path)).start()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker, keep_last=2) as m:
        for step in range(1, 6):
            m.save(step, {"w": torch.full((2,), float(step))}).wait()
    tracker.end()
    assert m.steps() == [4, 5]
    a = attribute_root(str(tmp_path))
    assert (a.committed_steps, a.retained_steps, a.deleted_steps) == ((1, 2, 3, 4, 5), (4, 5), (1, 2, 3))
    out = cli("report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "committed steps: 1, 2, 3, 4, 5\n  retained 4, 5; deleted since (retention, delete()): 1, 2, 3\n" in (
        out.stdout
    )
    report = json.loads(cli("report", str(tmp_path), "--json").stdout)
    assert (report["retained_steps"], report["deleted_steps"]) == ([4, 5], [1, 2, 3])


def test_a_step_committed_again_after_its_delete_is_retained(tmp_path):
    clock = FakeClock(0.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    for step in (10, 20, 30):
        tr.checkpoint_committed(step, 1.0)
    tr.checkpoint_deleted(10)
    tr.checkpoint_deleted(20)
    tr.checkpoint_committed(20, 1.0)  # a rollback wrote step 20 again
    tr.end()
    a = attribute_root(str(tmp_path))
    assert (a.retained_steps, a.deleted_steps) == ((20, 30), (10,))
    # a caller that sees step 10 in the root (committed=) knows better than the ledger
    assert attribute_root(str(tmp_path), committed=[10]).deleted_steps == ()


def test_with_two_tiers_a_step_is_retained_while_a_tier_holds_it(tmp_path):
    """Every save commits locally (keep_local=2), every 2nd is persisted (keep_last=1 on the durable root): step 2
    left the local tier and the durable one; 1 and 3 only had a local copy, gone; 4 is in both, 5 local only."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    tracker = GoodputTracker(str(durable)).start()
    with ckpt.CheckpointManager(durable, local=local, persist_every=2, keep_local=2, keep_last=1, tracker=tracker) as m:
        for step in range(1, 6):
            m.save(step, {"w": torch.full((2,), float(step))}).wait()
            m.wait()
    tracker.end()
    deletes = sorted(
        (r["s"], r.get("tier")) for ledger in read_ledgers(str(durable)) for r in ledger.records if r["k"] == "delete"
    )
    assert deletes == [(1, "local"), (2, "durable"), (2, "local"), (3, "local")]
    a = attribute_root(str(durable))
    assert (a.committed_steps, a.retained_steps, a.deleted_steps) == ((1, 2, 3, 4, 5), (4, 5), (1, 2, 3))


# -- (d) one mean restore time ---------------------------------------------------------------------------------


def restore_job(root: str) -> None:
    """a0 looks for a checkpoint for 2 s and finds none (a fresh start), saves step 5, dies; a1 restores step 5 in
    two spans (0.5 s from the local tier that fails, 1.5 s from the durable one), saves 10, dies; a2 restores 10 in
    1 s. Restores of a step: 2.0 s and 1.0 s; the fresh start's 2 s is no restore."""
    clock = FakeClock(1000.0)
    plan = [(None, (2.0,), 5), (5, (0.5, 1.5), 10), (10, (1.0,), 12)]
    for k, (resume, spans, last) in enumerate(plan):
        clock.set(1000.0 + 100.0 * k)
        tr = GoodputTracker(root, attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=0).start()
        for seconds in spans:
            with tr.span("checkpoint_restore"):
                clock.advance(seconds)
        tr.checkpoint_restored(resume)
        for s in range((resume or 0) + 1, last + 1):
            with tr.step(s):
                clock.advance(1.0)
            if s % 5 == 0:
                with tr.span("checkpoint_save", step=s):
                    clock.advance(0.25)
                tr.checkpoint_committed(s, 1.0)
        if k == len(plan) - 1:
            tr.end()


def test_report_and_advise_give_the_same_mean_restore(tmp_path):
    restore_job(str(tmp_path))
    a = attribute_root(str(tmp_path))
    assert a.restores() == [2.0, 1.0] and a.mean_restore_s() == 1.5
    assert advise(a).read_s == 1.5  # not (2 + 0.5 + 1.5 + 1) / 4 = 1.25, which counted spans and the fresh start
    report = cli("report", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert "restores of a step: 2, mean 1.500 s (T_read)" in report.stdout
    assert "T_read 1.500 s" in report.stdout
    assert "T_read 1.500 s" in cli("advise", str(tmp_path)).stdout
    as_json = json.loads(cli("report", str(tmp_path), "--json").stdout)
    assert as_json["mean_restore_seconds"] == as_json["advice"]["read_s"] == 1.5 and as_json["restores"] == 2
    assert json.loads(cli("advise", str(tmp_path), "--json").stdout)["read_s"] == 1.5


# -- (e) advice on a run too short to fit ----------------------------------------------------------------------


def short_run(root: str, *, save: bool = True) -> None:
    """5 steps of 1 ms, a save of 0.5 ms after the last, no failure: 5 ms of compute, 5.5 ms of running time."""
    clock = FakeClock(0.0)
    tr = GoodputTracker(root, attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    for s in range(1, 6):
        with tr.step(s):
            clock.advance(0.001)
    if save:
        with tr.span("checkpoint_save", step=5):
            clock.advance(0.0005)
        tr.checkpoint_committed(5, 0.01)
    tr.end()


def test_advise_says_a_run_is_too_short_to_fit(tmp_path):
    short_run(str(tmp_path))
    adv = advise(attribute_root(str(tmp_path)))
    # MTTF: no failure, so the 5.5 ms of running time; T_write 0.5 ms: "~2 steps" of advice on nothing
    assert adv.mttf_s == pytest.approx(0.0055) and adv.recommended_interval_s == pytest.approx(
        daly_interval(0.0005, 0.0055)
    )
    assert adv.too_short == "no failure in 0.0055 s of running (under 3600 s, the MTTF is unknown); pass --mttf"
    out = cli("advise", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"run too short to fit a checkpoint interval: {adv.too_short}" in out.stdout
    assert "current interval" not in out.stdout and "recommended interval" not in out.stdout
    assert json.loads(cli("advise", str(tmp_path), "--json").stdout)["too_short"] == adv.too_short
    assert integrations.advised_interval(str(tmp_path))() is None  # an AdvisedInterval keeps its start schedule
    # with a given MTTF the run's length no longer matters; small intervals print readably (not "0.0 s")
    given = advise(attribute_root(str(tmp_path)), mttf_s=3600.0)
    assert given.too_short is None and given.interval_s == 0.005
    assert "current interval 0.005 s -> expected ETTR" in given.text()
    assert f"recommended interval {given.recommended_interval_s:.3g} s (~" in given.text()
    assert integrations.advised_interval(str(tmp_path), mttf_s=3600.0)() == given.recommended_interval_s


def test_advise_says_so_when_the_fitted_interval_is_longer_than_the_run(tmp_path):
    """a0: steps 1-2 (1 s each), a 3 s save of step 2, then it dies; a1 restores 2 and runs step 3. One failure in
    6 s of running: MTTF 6 s, T_write 3 s, Daly's interval 4.17 s, more than the 3 s of compute the run did."""
    clock = FakeClock(0.0)
    for k, (resume, steps) in enumerate([(None, (1, 2)), (2, (3,))]):
        clock.set(100.0 * k)
        tr = GoodputTracker(str(tmp_path), attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=0).start()
        tr.checkpoint_restored(resume)
        for s in steps:
            with tr.step(s):
                clock.advance(1.0)
        if k == 0:
            with tr.span("checkpoint_save", step=2):
                clock.advance(3.0)
            tr.checkpoint_committed(2, 1.0)
        else:
            tr.end()
    adv = advise(attribute_root(str(tmp_path)))
    fitted = daly_interval(3.0, 6.0)
    assert (adv.mttf_s, adv.write_s, adv.mttf_failures) == (6.0, 3.0, 1) and adv.recommended_interval_s == fitted
    assert round(fitted, 2) == 4.17
    assert adv.too_short == (
        "the fitted interval (4.17 s) is longer than all 3 s of compute in its 3 step(s); run longer, or pass --mttf"
    )


def test_advise_without_a_save_says_so(tmp_path):
    short_run(str(tmp_path), save=False)
    adv = advise(attribute_root(str(tmp_path)), mttf_s=3600.0)
    assert adv.too_short == "5 step(s) and 0 save(s) in the ledger; a fit needs at least one of each"
    assert "run too short to fit a checkpoint interval: 5 step(s) and 0 save(s)" in adv.text()


def test_two_tier_advice_without_a_save_asks_for_the_local_write(tmp_path):
    """A run without a save tells no local save's cost: the two-tier plan was fitted with a stall of 0 s 'from the
    ledger' and advised saving every step (0 s without steps), where the one-tier advice said it could not fit."""
    short_run(str(tmp_path), save=False)
    given = TwoTierInputs(local_read_s=1.0, durable_read_s=5.0, local_mttf_s=100.0, node_mttf_s=1000.0)
    two = advise(attribute_root(str(tmp_path)), mttf_s=3600.0, two_tier=given).two_tier
    assert (two.plan, two.missing, "local_write_s" in two.values) == (None, ("--local-write",), False)
    assert "no two-tier plan: the ledger does not tell --local-write (pass them)" in two.text()
    assert advise(attribute_root(str(tmp_path)), two_tier=replace(given, local_write_s=0.5)).two_tier.plan is not None


def test_an_attempt_that_left_an_empty_ledger_neither_stops_the_next_one_nor_the_report(tmp_path):
    """An attempt killed (or out of disk) between creating its ledger and writing its start record leaves 0 bytes:
    the next attempt's restore, which attributes the earlier attempts for telemetry, trains on, and the report
    leaves the empty ledger out, saying so."""
    root, clock = str(tmp_path), FakeClock(1000.0)
    first = GoodputTracker(root, attempt_id="a1", clock=clock).start()
    first.checkpoint_restored(None)
    for s in range(1, 6):
        first.step_begin(s)
        clock.advance(1.0)
        first.step_end(s)
    first.checkpoint_committed(5, 0.1)
    first.flush()  # then it dies: no end
    open(os.path.join(root, "ettr", "ledger-a2-rank0.jsonl"), "w").close()  # the attempt after it: 0 bytes
    clock.advance(30.0)
    third = GoodputTracker(root, attempt_id="a3", clock=clock).start()
    with pytest.warns(RuntimeWarning, match="ledger-a2-rank0.jsonl: an empty ledger"):
        third.checkpoint_restored(5)
    third.end()
    with pytest.warns(RuntimeWarning, match="an empty ledger"):
        a = attribute_root(root)
    assert [at.attempt for at in a.attempts] == ["a1", "a3"] and a.failures == 1
    out = cli("report", root)
    assert out.returncode == 0 and "ETTR" in out.stdout and "an empty ledger" in out.stderr, out.stderr
