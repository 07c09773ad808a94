"""The checkpoint's cost, split (issue 27, item 3): save()'s stall, its wait for the previous save, optimizer steps'
waits for an overlapped snapshot; the background write beside them. Exact numbers on a fake clock, one histogram
observation per save read back through the OpenTelemetry SDK, and ledgers written before the split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ettr import FakeClock, GoodputTracker, advise, attribute_root, configure_metrics, metric_totals
from ettr.telemetry import DURATION_BUCKETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overlapped_job(root: str, **options):
    """One attempt from 1000 s: 1 s of startup, then 7 saves of 1 s steps, as the manager reports them with
    snapshot="overlap": a save every 2 steps, its stall 0.25 s; saves 2 and 3 (steps 4 and 6) first wait 0.5 s for
    the previous save inside save(); the optimizer step after saves 1 and 2 (steps 3 and 5) waits 0.125 s for its
    overlapped snapshot. Each save commits 3 s of background work. Returns the tracker and its metric reader."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(root, job_id="job", attempt_id="a1", rank=0, clock=clock, flush_interval=0, **options)
    _, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    clock.advance(1.0)
    for s in range(1, 15):
        with tr.step(s):
            clock.advance(1.0)
            if s in (3, 5):  # the optimizer step of step s waits for the copies of the save of step s - 1
                with tr.span("checkpoint_save", step=s - 1, part="overlap_wait"):
                    clock.advance(0.125)
        if s % 2 == 0:
            with tr.span("checkpoint_save", step=s):
                if s in (4, 6):
                    with tr.span("checkpoint_save", step=s, part="previous_wait"):
                        clock.advance(0.5)
                clock.advance(0.25)
            tr.checkpoint_committed(s, 3.0, 1024)
    tr.end()
    return tr, reader


# Worked out from the plan above, not from the code: 7 saves of 0.25 s stall, 2 waits of 0.5 s for the previous
# save, 2 optimizer-step waits of 0.125 s; 14 steps of 1 s; 7 background writes of 3 s.
SPLIT = {"stall": 7 * 0.25, "previous_wait": 2 * 0.5, "overlap_wait": 2 * 0.125}
WALL = 1.0 + 14 * 1.0 + sum(SPLIT.values())


def test_the_split_sums_to_checkpoint_save_and_each_part_is_exact(tmp_path):
    overlapped_job(str(tmp_path))
    a = attribute_root(str(tmp_path))
    assert a.saves == 7 and len(a.save_us) == 7
    assert a.save_us == (250_000, 750_000, 750_000, 250_000, 250_000, 250_000, 250_000)  # a save() call each
    assert {p: us / 1e6 for p, us in a.checkpoint_split_us.items()} == SPLIT
    assert a.micros["checkpoint_save"] == sum(a.checkpoint_split_us.values()) == 3_000_000
    assert a.micros["productive"] == 14_000_000 and a.micros["startup"] == 1_000_000
    assert a.wall_us == round(WALL * 1e6) and a.background_us == 21_000_000
    assert a.attempts[0].checkpoint_split_us == a.checkpoint_split_us and a.attempts[0].saves == 7
    # the timeline shows each save once: a wait inside a save is no segment of its own
    saves = [s for s in a.segments if s.category == "checkpoint_save"]
    assert [(s.end_us - s.begin_us) / 1e6 for s in saves] == [0.25, 0.125, 0.75, 0.125, 0.75, 0.25, 0.25, 0.25, 0.25]


def test_advice_takes_the_stall_and_overlap_waits_per_save_as_the_write_cost(tmp_path):
    overlapped_job(str(tmp_path))
    adv = advise(attribute_root(str(tmp_path)), mttf_s=3600.0)
    # (1.75 s of stall + 0.25 s of optimizer-step waits) / 7 saves; the 1 s of waiting for the previous save is not
    # what a save costs at the advised interval, and neither is the 21 s of background writing
    assert adv.write_s == pytest.approx(2.0 / 7, abs=1e-12)
    assert adv.interval_s == 2.0  # 14 s of compute over 7 saves
    assert "T_write 0.286 s (stall + overlap waits per save)" in adv.text()


def test_report_shows_the_split_and_json_has_its_fields(tmp_path):
    overlapped_job(str(tmp_path))
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "ettr", *args], capture_output=True, text=True, cwd=REPO
    )
    out = run("report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (
        "checkpoint_save = stall 1.750000 s + waiting for the previous save 1.000000 s + optimizer steps waiting for "
        "an overlapped snapshot 0.250000 s; 7 save(s); background write 21.000000 s (not badput)"
    ) in out.stdout
    report = json.loads(run("report", str(tmp_path), "--json").stdout)
    assert report["checkpoint_save_split"] == SPLIT and report["saves"] == 7
    assert report["attempts"][0]["checkpoint_save_split"] == SPLIT
    assert report["background_checkpoint_seconds"] == 21.0 and report["seconds"]["checkpoint_save"] == 3.0


def _histograms(reader) -> dict[str, object]:
    data = reader.get_metrics_data()
    return {
        m.name: m.data.data_points[0]
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name.endswith(".duration")
    }


def test_one_histogram_observation_per_save_with_buckets_from_one_millisecond(tmp_path):
    _, reader = overlapped_job(str(tmp_path))
    h = _histograms(reader)
    save = h["ettr.checkpoint_save.duration"]
    assert save.count == 7 and save.sum == pytest.approx(7 * 0.25 + 2 * 0.5)  # 7 saves, not 9 (nor 11)
    assert (h["ettr.checkpoint_previous_wait.duration"].count, h["ettr.checkpoint_previous_wait.duration"].sum) == (
        2,
        1.0,
    )
    assert (h["ettr.checkpoint_overlap_wait.duration"].count, h["ettr.checkpoint_overlap_wait.duration"].sum) == (
        2,
        0.25,
    )
    write = h["ettr.checkpoint_write.duration"]
    assert (write.count, write.sum) == (7, 21.0)
    for point in h.values():  # the SDK took the instruments' advisory boundaries
        assert tuple(point.explicit_bounds) == DURATION_BUCKETS
    assert DURATION_BUCKETS[:4] == (0.001, 0.0025, 0.005, 0.01)
    # 0.25 s falls in (0.1, 0.25], 0.75 s in (0.5, 1]; 0.125 s in (0.1, 0.25]
    assert (
        save.bucket_counts[DURATION_BUCKETS.index(0.25)] == 5 and save.bucket_counts[DURATION_BUCKETS.index(1.0)] == 2
    )
    assert metric_totals(reader)["ettr.checkpoint_save.duration"] == {"count": 7, "sum": pytest.approx(2.75)}


def test_a_few_milliseconds_land_above_the_lowest_bucket(tmp_path):
    """Today's stalls are milliseconds: 2 ms and 4 ms go into the 2.5 ms and 5 ms buckets, not one 10 ms bucket."""
    clock = FakeClock(0.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=clock, flush_interval=0)
    _, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    for s, stall in ((1, 0.002), (2, 0.004), (3, 0.0005)):
        with tr.span("checkpoint_save", step=s):
            clock.advance(stall)
    tr.end()
    save = _histograms(reader)["ettr.checkpoint_save.duration"]
    assert save.count == 3 and list(save.bucket_counts[:4]) == [1, 1, 1, 0]


def test_an_unknown_part_is_refused(tmp_path):
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=FakeClock(0.0)).start()
    with pytest.raises(ValueError, match="part of a checkpoint_save must be one of previous_wait, overlap_wait"):
        with tr.span("checkpoint_save", part="write"):
            pass
    tr.end()


def test_a_save_step_that_is_not_an_integer_is_refused(tmp_path):
    """The ledger's reader refuses such a record, so the tracker refuses it at the call, before it is written."""
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=FakeClock(0.0)).start()
    with pytest.raises(TypeError, match="step of a checkpoint_save must be an integer, got list"):
        with tr.span("checkpoint_save", step=[2]):
            pass
    tr.end()


def test_a_ledger_written_before_the_split_still_reports(tmp_path):
    """Format 1 (and a ledger without a version): no parts; an optimizer step's wait was a second checkpoint_save
    span of the step just saved. It reads as an overlap wait, not as a save."""
    (tmp_path / "ettr").mkdir()
    lines = [
        {"k": "start", "t": 0, "job": "j", "attempt": "old", "rank": 0, "pid": 1, "host": "h", "v": 1},
        {"k": "step", "s": 1, "b": 1_000_000, "e": 2_000_000, "o": 1},
        {"k": "span", "c": "checkpoint_save", "b": 2_000_000, "e": 2_500_000, "o": 2, "a": {"step": 1}},
        {"k": "commit", "s": 1, "t": 2_600_000, "bg": 1.5},
        {"k": "span", "c": "checkpoint_save", "b": 3_000_000, "e": 3_200_000, "o": 4, "a": {"step": 1}},
        {"k": "step", "s": 2, "b": 2_500_000, "e": 3_500_000, "o": 3},
        {"k": "span", "c": "checkpoint_save", "b": 3_500_000, "e": 3_800_000, "o": 5},  # an integration's, no step
        {"k": "end", "t": 3_800_000, "status": "ok"},
    ]
    (tmp_path / "ettr" / "ledger-old-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    a = attribute_root(str(tmp_path))
    assert a.saves == 2 and a.save_us == (500_000, 300_000)
    assert a.checkpoint_split_us == {"stall": 800_000, "previous_wait": 0, "overlap_wait": 200_000}
    assert a.micros["checkpoint_save"] == 1_000_000
    out = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(tmp_path)], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert "stall 0.800000 s + waiting for the previous save 0.000000 s" in out.stdout
    assert "overlapped snapshot 0.200000 s; 2 save(s)" in out.stdout
    # format 2 takes spans at their word: a second span of a step without a part is a save
    lines[0]["v"] = 2
    (tmp_path / "ettr" / "ledger-old-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert attribute_root(str(tmp_path)).saves == 3


def test_the_job_gauge_splits_the_checkpoint_time_across_a_restart(tmp_path):
    """a2 continues the job of overlapped_job: a restore of step 14 (0.5 s), steps 15-16, a save of 16 that first
    waits 0.25 s for the previous save and stalls 0.25 s, 2 s in the background. The job gauge adds a1's parts, read
    from its ledger, to a2's own, live: the same numbers as the report's."""
    root = str(tmp_path)
    overlapped_job(root)
    clock = FakeClock(2000.0)
    tr = GoodputTracker(root, job_id="job", attempt_id="a2", rank=0, clock=clock, flush_interval=0)
    _, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    with tr.span("checkpoint_restore"):
        clock.advance(0.5)
    tr.checkpoint_restored(14)
    for s in (15, 16):
        with tr.step(s):
            clock.advance(1.0)
    with tr.span("checkpoint_save", step=16):
        with tr.span("checkpoint_save", step=16, part="previous_wait"):
            clock.advance(0.25)
        clock.advance(0.25)
    tr.checkpoint_committed(16, 2.0, 1024)
    tr.flush()
    expected = {"stall": 2.0, "previous_wait": 1.25, "overlap_wait": 0.25, "background_write": 23.0}
    assert metric_totals(reader)["checkpoint_seconds"] == expected
    a = attribute_root(root)
    assert {**{p: us / 1e6 for p, us in a.checkpoint_split_us.items()}, "background_write": a.background_us / 1e6} == (
        expected
    )
    tr.end()
