"""Replay verification (issue 27, item 1): the steps a resumed attempt trains again are compared bit for bit with
their first pass. A scripted three-attempt job on a fake clock, read back by attribution, the report (text, JSON,
CLI), the live tracker and its OpenTelemetry counters; ledgers written before digests still report."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest

from ettr import FakeClock, GoodputTracker, LedgerError, attribute_root, configure_metrics, metric_totals, report_text
from ettr.replay import Digest, Divergence, FirstPasses, bits_value, float_bits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loss_of(step: int) -> float:
    """Exact in binary: step 7's loss is 1.125, 0x3ff2000000000000."""
    return 2.0 - step / 8


def attempt(root: str, clock: FakeClock, name: str, at: float, restored: int | None, steps, *, perturb=(), end=False):
    """One attempt from `at`: 1 s of startup, a 0.5 s restore of `restored`, 1 s steps with their loss and batch hash
    (`perturb`: steps whose loss is one ulp higher), a 0.25 s save of step 4 (committed). Returns the tracker and its
    metric reader."""
    clock.set(at)
    tr = GoodputTracker(root, job_id="job", attempt_id=name, rank=0, clock=clock, flush_interval=0)
    _, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    clock.advance(1.0)
    with tr.span("checkpoint_restore"):
        clock.advance(0.5)
    tr.checkpoint_restored(restored)
    for s in steps:
        loss = math.nextafter(loss_of(s), math.inf) if s in perturb else loss_of(s)
        with tr.step(s) as step:
            clock.advance(1.0)
            step.record(loss, batch=f"b{s:015x}", scalars={"grad_norm": s / 4})
        if s == 4:
            with tr.span("checkpoint_save", step=s):
                clock.advance(0.25)
            tr.checkpoint_committed(s, 1.0)
    if end:
        tr.end()
    return tr, reader


def three_attempts(root: str):
    """a1 trains 1-6 and dies (checkpoint 4); a2 resumes from 4, trains 5-7 and dies; a3 resumes from 4 and trains
    5-9, step 7 one ulp off its first pass (a2's). Returns a3's tracker and reader."""
    clock = FakeClock(1000.0)
    attempt(root, clock, "a1", 1000.0, None, range(1, 7))
    attempt(root, clock, "a2", 1010.0, 4, range(5, 8))
    return attempt(root, clock, "a3", 1020.0, 4, range(5, 10), perturb=(7,), end=True)


SEVEN = "3ff2000000000000"  # 1.125
SEVEN_OFF = "3ff2000000000001"  # 1.1250000000000002


def test_each_replayed_step_is_compared_with_its_latest_first_pass(tmp_path):
    root = str(tmp_path)
    three_attempts(root)
    a = attribute_root(root)
    # a1 replays nothing; a2 steps 5 and 6 (a1's), equal; a3 steps 5, 6, 7 (a2's passes), 7 diverged
    assert [(at.replay.replayed, at.replay.equal, at.replay.diverged) for at in a.attempts] == [
        (0, 0, 0),
        (2, 2, 0),
        (3, 2, 1),
    ]
    r = a.replay
    assert (r.replayed, r.equal, r.diverged, r.unverified) == (5, 4, 1, 0)
    d = r.first_divergence
    assert (d.step, d.attempt, d.first_attempt) == (7, "a3", "a2")
    assert d.first == Digest(SEVEN, "b000000000000007", (("grad_norm", float_bits(1.75)),))
    assert d.again == Digest(SEVEN_OFF, "b000000000000007", (("grad_norm", float_bits(1.75)),))
    assert d.text() == "loss 0x3ff2000000000000 (1.125) vs 0x3ff2000000000001 (1.1250000000000002), batch equal"
    assert d.explain == f"python -m ckpt explain {root} --step 7"
    # the rest of the accounting is untouched: a1 lost 5-6, a2 lost 5-7
    assert [at.lost_steps for at in a.attempts] == [2, 3, 0]
    assert a.micros["productive"] == 9_000_000 and a.micros["lost"] == 5_000_000


def test_the_report_says_how_many_steps_were_equal_and_where_the_first_divergence_is(tmp_path):
    root = str(tmp_path)
    three_attempts(root)
    lines = report_text(attribute_root(root)).splitlines()
    at = lines.index(
        "replayed 5 step(s): 4 bitwise equal, 1 diverged; diverged first at step 7: loss 0x3ff2000000000000 (1.125) "
        "vs 0x3ff2000000000001 (1.1250000000000002), batch equal"
    )
    assert lines[at + 1] == f"  its batch: python -m ckpt explain {root} --step 7"
    out = subprocess.run(
        [sys.executable, "-m", "ettr", "report", root, "--json"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {k: v for k, v in report["replay"].items() if k != "first_divergence"} == {
        "replayed": 5,
        "equal": 4,
        "diverged": 1,
        "unverified": 0,
    }
    first = report["replay"]["first_divergence"]
    assert (first["step"], first["attempt"], first["first_attempt"]) == (7, "a3", "a2")
    assert first["first"] == {"loss": SEVEN, "batch": "b000000000000007", "scalars": {"grad_norm": float_bits(1.75)}}
    assert first["again"]["loss"] == SEVEN_OFF and first["explain"].endswith(" --step 7")
    assert [x["replay"]["replayed"] for x in report["attempts"]] == [0, 2, 3]


def test_the_live_tracker_compares_as_it_goes_counts_in_telemetry_and_warns_once(tmp_path, caplog):
    root = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ettr"):
        tr, reader = three_attempts(root)
    replay = tr.replay()
    assert (replay.replayed, replay.equal, replay.diverged, replay.through) == (3, 2, 1, None)
    assert replay.first_divergence.step == 7
    assert metric_totals(reader)["replay"] == {"steps": 3, "divergences": 1, "first_divergence": 7}
    (said,) = [r.getMessage() for r in caplog.records if r.name == "ettr"]
    assert said == (
        "replay diverged at step 7: loss 0x3ff2000000000000 (1.125) vs 0x3ff2000000000001 (1.1250000000000002), "
        f"batch equal (attempt a3 against a2); its batch: python -m ckpt explain {root} --step 7"
    )


def test_a_resumed_tracker_knows_what_is_left_to_replay(tmp_path):
    """Mid-replay: a2 resumed from 4 has trained 5; 6 is still to come (a1 trained it), then 7 is new."""
    root, clock = str(tmp_path), FakeClock(1000.0)
    attempt(root, clock, "a1", 1000.0, None, range(1, 7))
    tr, reader = attempt(root, clock, "a2", 1010.0, 4, [5])
    replay = tr.replay()
    assert (replay.replayed, replay.equal, replay.through) == (1, 1, 6)
    assert replay.text() == "replayed 1 step(s): 1 bitwise equal"
    with tr.step(6) as step:
        step.record(loss_of(6), batch="b000000000000006", scalars={"grad_norm": 6 / 4})
    assert tr.replay().text() == "replayed 2 step(s): 2 bitwise equal" and tr.replay().through is None
    assert metric_totals(reader)["replay"] == {"steps": 2}


def test_a_different_batch_and_a_different_scalar_are_named():
    first = Digest(SEVEN, "aaaa", (("grad_norm", float_bits(0.5)),))
    again = Digest(SEVEN, "bbbb", (("grad_norm", float_bits(0.75)),))
    d = Divergence(3, "a2", "a1", first, again, "python -m ckpt explain R --step 3")
    assert d.text() == (
        "loss equal, batch aaaa vs bbbb, grad_norm 0x3fe0000000000000 (0.5) vs 0x3fe8000000000000 (0.75)"
    )
    assert bits_value(float_bits(-0.0)) == -0.0 and float_bits(float("inf")) == "7ff0000000000000"


def test_a_ledger_written_before_digests_still_reports_its_replays_as_unverified(tmp_path):
    """An old attempt (step records without digests) resumed by a new one: its steps were replayed, nothing to
    compare; a step record with a malformed loss is an error naming file and line."""
    (tmp_path / "ettr").mkdir()
    lines = [
        {"k": "start", "t": 0, "job": "j", "attempt": "old", "rank": 0, "pid": 1, "host": "h", "v": 2},
        *({"k": "step", "s": s, "b": s * 1_000_000, "e": (s + 1) * 1_000_000, "o": s} for s in (1, 2, 3)),
        {"k": "commit", "s": 1, "t": 2_000_000, "bg": 0.5},
    ]
    (tmp_path / "ettr" / "ledger-old-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    clock = FakeClock(10.0)
    attempt(str(tmp_path), clock, "new", 10.0, 1, range(2, 5), end=True)
    a = attribute_root(str(tmp_path))
    r = a.replay
    assert (r.replayed, r.equal, r.diverged, r.unverified, r.first_divergence) == (2, 0, 0, 2, None)
    assert "replayed 2 step(s): 0 bitwise equal, 2 without a digest on both passes" in report_text(a)
    assert [at.lost_steps for at in a.attempts] == [2, 0]
    lines.append({"k": "step", "s": 4, "b": 4_000_000, "e": 5_000_000, "o": 4, "l": "1.5"})
    (tmp_path / "ettr" / "ledger-old-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(LedgerError, match=r"ledger-old-rank0.jsonl:6: field 'l' of a 'step' record must be 16 hex"):
        attribute_root(str(tmp_path))


def test_a_job_without_a_restart_says_nothing_of_replays(tmp_path):
    clock = FakeClock(0.0)
    attempt(str(tmp_path), clock, "only", 0.0, None, range(1, 4), end=True)
    a = attribute_root(str(tmp_path))
    assert a.replay.replayed == 0 and "replayed" not in report_text(a)
    assert a.to_dict()["replay"] == {
        "replayed": 0,
        "equal": 0,
        "diverged": 0,
        "unverified": 0,
        "first_divergence": None,
    }


def test_a_batch_hash_must_be_a_string(tmp_path):
    tr = GoodputTracker(str(tmp_path), clock=FakeClock(0.0)).start()
    tr.step_begin(1)
    with pytest.raises(TypeError, match=r"batch must be the batch hash as a string .* got 7"):
        tr.step_end(1, 0.5, batch=7)


def test_the_steps_to_train_again_include_those_first_trained_below_earlier_ones():
    """FirstPasses finds the steps above a resume point by bisection in its steps kept in order: a1 trained 1-4 and
    20-21, a2 trained 5 and 6 for the first time (below 20, merged in order) and 20 again, a3 trained 7."""
    d = {s: Digest(float_bits(loss_of(s))) for s in (1, 2, 3, 4, 5, 6, 7, 20, 21)}
    passes = FirstPasses()
    passes.add("a1", {s: d[s] for s in (1, 2, 3, 4, 20, 21)})
    passes.add("a2", {s: d[s] for s in (5, 6, 20)})
    passes.add("a3", {7: d[7]})
    assert passes.after(6) == {7: ("a3", d[7]), 20: ("a2", d[20]), 21: ("a1", d[21])}
    assert passes.after(4).keys() == {5, 6, 7, 20, 21}
    assert passes.after(-math.inf) == {**{s: ("a1", d[s]) for s in (1, 2, 3, 4, 21)}, **passes.after(4)}
    assert passes.after(21) == {} == passes.after(math.inf)
