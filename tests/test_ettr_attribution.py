"""Scripted timelines on a fake clock: seconds per category computed by hand, exact to the microsecond."""

from __future__ import annotations

import json
import os
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import ettr.cli
from ettr import (
    CATEGORIES,
    FakeClock,
    GoodputMetrics,
    GoodputTracker,
    LedgerError,
    RootFollower,
    attribute,
    attribute_root,
    metric_totals,
)
from ettr.clock import to_us
from ettr.ledger import read_ledgers


def expected(**seconds: float) -> dict[str, int]:
    """Every category in microseconds, zero unless given."""
    return {c: to_us(seconds.get(c, 0.0)) for c in CATEGORIES}


def attempt(root, clock, name, at=None, metrics=None) -> GoodputTracker:
    """Start one process attempt (flush at every step, so a 'crash' loses nothing recorded)."""
    if at is not None:
        clock.set(at)
    return GoodputTracker(
        str(root), attempt_id=name, rank=0, job_id="job", clock=clock, flush_interval=0, metrics=metrics
    ).start()


def steps(tr, clock, first, last, seconds):
    for s in range(first, last + 1):
        tr.step_begin(s)
        clock.advance(seconds)
        tr.step_end(s)


def save(tr, clock, step, seconds, bg=None):
    with tr.span("checkpoint_save", step=step):
        clock.advance(seconds)
    if bg is not None:
        tr.checkpoint_committed(step, bg)


def restore(tr, clock, step, seconds):
    with tr.span("checkpoint_restore"):
        clock.advance(seconds)
    tr.checkpoint_restored(step)


def check_sum(a):
    assert sum(a.micros.values()) == a.wall_us
    for at in a.attempts:
        assert sum(at.micros.values()) == at.end_us - at.start_us


def test_no_failure(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    clock.advance(2.0)
    restore(tr, clock, None, 3.0)
    for s in range(1, 5):
        tr.step_begin(s)
        with tr.span("data_wait"):
            clock.advance(0.250001)
        clock.advance(1.249999)
        tr.step_end(s)
        if s % 2 == 0:
            save(tr, clock, s, 0.5, bg=0.75)
    clock.advance(0.1)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(
        startup=2.0, checkpoint_restore=3.0, data_wait=1.000004, productive=4.999996, checkpoint_save=1.0, other=0.1
    )
    assert a.wall_us == to_us(12.1)
    assert a.background_us == to_us(1.5)
    assert a.failures == 0 and a.attempts[0].status == "ok"
    assert a.committed_steps == (2, 4)
    assert tr.totals_us(a.end_us) == {k: v for k, v in a.micros.items() if v}  # live totals agree with the ledger
    check_sum(a)


def two_attempts(root, metrics=None):
    """Checkpoints at steps 2 and 4, a crash after step 7, a resume from 4 to step 8."""
    clock = FakeClock(1000.0)
    tr = attempt(root, clock, "a1")
    clock.advance(1.0)
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    steps(tr, clock, 3, 4, 1.0)
    save(tr, clock, 4, 0.5, bg=1.0)
    steps(tr, clock, 5, 7, 1.0)  # then SIGKILL: no end()
    tr = attempt(root, clock, "a2", at=1100.0, metrics=metrics)
    clock.advance(2.0)
    restore(tr, clock, 4, 1.0)
    steps(tr, clock, 5, 6, 1.0)
    save(tr, clock, 6, 0.5, bg=1.0)
    steps(tr, clock, 7, 8, 1.0)
    save(tr, clock, 8, 0.5, bg=1.0)
    tr.end()
    return tr


TWO_ATTEMPTS = expected(
    startup=3.0, checkpoint_restore=1.5, checkpoint_save=2.0, productive=8.0, lost=3.0, downtime=90.5
)


def test_one_crash_after_two_checkpoints(tmp_path):
    reader = InMemoryMetricReader()
    metrics = GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    two_attempts(tmp_path, metrics)
    a = attribute_root(str(tmp_path))
    assert a.micros == TWO_ATTEMPTS
    assert a.wall_us == to_us(108.0)
    assert [at.status for at in a.attempts] == ["failed", "ok"]
    assert [at.lost_steps for at in a.attempts] == [3, 0]
    assert a.attempts[1].restored_step == 4
    assert a.background_us == to_us(4.0)
    check_sum(a)
    # The second process's OpenTelemetry counter carries the whole job: earlier attempt from its ledger + itself live.
    seen = metric_totals(reader)
    assert seen["seconds"] == pytest.approx({k: v / 1e6 for k, v in a.micros.items() if v}, abs=1e-6)
    assert seen["failures"] == 1
    assert seen["ettr"]["cumulative"] == pytest.approx(a.ettr)
    assert seen["ettr.checkpoint_save.duration"]["count"] == 2


def test_crash_during_blocking_save(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=0.3)
    steps(tr, clock, 3, 4, 1.0)
    tr.span("checkpoint_save", step=4).__enter__()  # the save's begin is flushed, then SIGKILL 0.4 s into it
    clock.advance(0.4)
    tr = attempt(tmp_path, clock, "a2", at=1010.0)
    restore(tr, clock, 2, 1.0)
    steps(tr, clock, 3, 5, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    # the unfinished save ends at the last sign of life (its own begin); the 0.4 s after it are downtime
    assert a.micros == expected(checkpoint_restore=1.5, productive=5.0, lost=2.0, checkpoint_save=0.5, downtime=5.0)
    check_sum(a)


def test_crash_during_background_write_infers_resume_from_commits(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=0.3)
    steps(tr, clock, 3, 4, 1.0)
    save(tr, clock, 4, 0.5)  # blocking part done, killed before the background write committed
    steps(tr, clock, 5, 5, 1.0)
    tr = attempt(tmp_path, clock, "a2", at=1020.0)  # no manager: no restore record, resumes at step 3
    clock.advance(1.0)
    steps(tr, clock, 3, 6, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(
        checkpoint_restore=0.5, checkpoint_save=1.0, productive=6.0, lost=3.0, downtime=13.5, startup=1.0
    )
    assert a.committed_steps == (2,)
    check_sum(a)


def test_two_crashes_before_a_new_checkpoint(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 3, 1.0)
    save(tr, clock, 3, 0.5, bg=0.2)
    steps(tr, clock, 4, 6, 1.0)
    tr = attempt(tmp_path, clock, "a2", at=1010.0)
    restore(tr, clock, 3, 1.0)
    steps(tr, clock, 4, 5, 1.0)
    tr = attempt(tmp_path, clock, "a3", at=1020.0)
    restore(tr, clock, 3, 1.0)
    steps(tr, clock, 4, 7, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(checkpoint_restore=2.5, checkpoint_save=0.5, productive=7.0, lost=5.0, downtime=10.0)
    assert [at.lost_steps for at in a.attempts] == [3, 2, 0]
    assert a.failures == 2
    check_sum(a)


def test_a_rollback_inside_an_attempt_loses_its_own_steps_above_the_step_restored(tmp_path):
    """a1 trains 1-6 (checkpoint 3) and dies; a2 restores 3, trains 4-6, then rolls back in the same process
    (a loss spike: restore(step=3) again) and trains 4-8. Its first runs of 4-6 were thrown away as a1's were: they
    counted as productive, 3 s more than the 8 steps that survived, and no step of a2 as lost."""
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 3, 1.0)
    save(tr, clock, 3, 0.5, bg=0.2)
    steps(tr, clock, 4, 6, 1.0)
    tr = attempt(tmp_path, clock, "a2", at=1010.0)
    restore(tr, clock, 3, 1.0)
    steps(tr, clock, 4, 6, 1.0)
    restore(tr, clock, 3, 1.0)
    steps(tr, clock, 4, 8, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(checkpoint_restore=2.5, checkpoint_save=0.5, productive=8.0, lost=6.0, downtime=3.0)
    assert [at.lost_steps for at in a.attempts] == [3, 3]
    check_sum(a)


def test_crash_before_first_checkpoint(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    clock.advance(3.0)
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 4, 1.0)
    tr = attempt(tmp_path, clock, "a2", at=1010.0)
    clock.advance(3.0)
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 4, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(startup=6.0, checkpoint_restore=1.0, lost=4.0, productive=4.0, downtime=2.5)
    check_sum(a)


def test_torn_last_line_is_dropped(tmp_path):
    two_attempts(tmp_path)
    [first] = [l for l in read_ledgers(str(tmp_path)) if l.attempt == "a1"]
    with open(first.source, "a") as f:
        f.write('{"k":"step","s":8,"b":10095')  # SIGKILL in the middle of a write
    a = attribute_root(str(tmp_path))
    assert a.micros == TWO_ATTEMPTS
    assert [at.torn for at in a.attempts] == [True, False]


def test_bad_line_in_the_middle_names_file_and_line(tmp_path):
    two_attempts(tmp_path)
    [first] = [l for l in read_ledgers(str(tmp_path)) if l.attempt == "a1"]
    lines = open(first.source).read().splitlines(keepends=True)
    lines[3] = "not json\n"
    open(first.source, "w").write("".join(lines))
    with pytest.raises(LedgerError, match=r"ledger-a1-rank0\.jsonl:4:"):
        attribute_root(str(tmp_path))


def test_a_line_too_deep_for_json_names_file_and_line(tmp_path):
    two_attempts(tmp_path)
    [first] = [l for l in read_ledgers(str(tmp_path)) if l.attempt == "a1"]
    lines = open(first.source).read().splitlines(keepends=True)
    lines[3] = "[" * 100_000 + "\n"  # RecursionError, a traceback
    open(first.source, "w").write("".join(lines))
    with pytest.raises(LedgerError, match=r"ledger-a1-rank0\.jsonl:4: not a JSON record \(RecursionError"):
        attribute_root(str(tmp_path))


@pytest.mark.parametrize("special", ["fifo", "device", "directory"])
def test_a_ledger_that_is_not_a_regular_file_is_an_error_never_a_hang_or_an_endless_read(tmp_path, special):
    """Named by its path (a directory was '[Errno 21] Is a directory: 3', naming a file descriptor)."""
    two_attempts(tmp_path)
    path = tmp_path / "ettr" / "ledger-zzz-rank0.jsonl"
    {"fifo": os.mkfifo, "device": lambda p: os.symlink("/dev/zero", p), "directory": os.mkdir}[special](path)
    with pytest.raises(LedgerError, match=r"ledger-zzz-rank0\.jsonl: not a regular file"):
        attribute_root(str(tmp_path))


def test_object_store_ledger_in_segments():
    """Object stores get the step records of the last upload interval (60 s) only at the next upload: the three
    steps between the last commit and the crash never reached the store, so they count as downtime, not lost."""
    root = "memory://ettr-segments"
    two_attempts(root)
    ledgers = read_ledgers(root)
    assert len(ledgers) == 2 and all(".000000.jsonl" in l.source for l in ledgers)
    assert attribute_root(root).micros == {**TWO_ATTEMPTS, "lost": 0, "downtime": TWO_ATTEMPTS["downtime"] + to_us(3)}


def test_windowed_ettr(tmp_path):
    two_attempts(tmp_path)
    a = attribute_root(str(tmp_path), window_s=10.0)
    # last 10 s (1098..1108): downtime to 1100, startup 2, restore 1, steps 5-6, save, steps 7-8, save
    assert a.ettr_window() == pytest.approx(4.0 / 10.0)
    assert a.ettr == pytest.approx(8.0 / 108.0)
    for window in (
        0,
        1e-300,
        float("nan"),
        -1.0,
    ):  # rounded to no microsecond, an ETTR of 0 (nan: a ValueError of round)
        with pytest.raises(ValueError, match="window_s must be"):
            a.ettr_window(window)
        with pytest.raises(ValueError, match="window_s must be"):
            attribute_root(str(tmp_path), window_s=window)


def test_step_end_without_begin_is_an_error(tmp_path):
    tr = attempt(tmp_path, FakeClock(), "a1")
    with pytest.raises(ValueError, match=r"step_end\(3\)"):
        tr.step_end(3)


@pytest.mark.parametrize("second_start", [1005.0, 900.0], ids=["inside-previous", "before-previous"])
def test_a_wall_clock_that_went_back_between_attempts_invents_no_downtime(tmp_path, second_start):
    """Attempt 2 restores step 4 (committed at 1006.5) but its clock reads 1005 or 900: it ran after attempt 1 all
    the same, so it is placed at attempt 1's last record (1009.5): nothing lost twice, no downtime, a warning."""
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    clock.advance(1.0)
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    steps(tr, clock, 3, 4, 1.0)
    save(tr, clock, 4, 0.5, bg=1.0)
    steps(tr, clock, 5, 7, 1.0)  # killed here, at 1009.5
    clock = FakeClock(second_start)
    tr = attempt(tmp_path, clock, "a2")
    clock.advance(2.0)
    restore(tr, clock, 4, 1.0)
    steps(tr, clock, 5, 6, 1.0)
    save(tr, clock, 6, 0.5, bg=1.0)
    steps(tr, clock, 7, 8, 1.0)
    save(tr, clock, 8, 0.5, bg=1.0)
    tr.end()
    with pytest.warns(RuntimeWarning, match="attempt a2 .* wall clock went back.*no downtime"):
        a = attribute_root(str(tmp_path))
    assert a.micros == expected(startup=3.0, checkpoint_restore=1.5, checkpoint_save=2.0, productive=8.0, lost=3.0)
    assert a.wall_us == to_us(17.5)
    assert [(at.attempt, at.start_us, at.end_us) for at in a.attempts] == [
        ("a1", to_us(1000.0), to_us(1009.5)),
        ("a2", to_us(1009.5), to_us(1017.5)),
    ]
    check_sum(a)


@pytest.mark.parametrize(
    "line, field, value",
    [
        (8, "b", "soon"),
        (8, "s", 1.5),
        (8, "e", None),
        (4, "c", 7),
        (2, "t", True),
        (1, "rank", "0"),
        (6, "s", "4"),
        (15, "bg", "1s"),
        (15, "bg", -1e308),  # OverflowError in the arithmetic, a traceback
        (15, "bg", float("nan")),  # "cannot convert float NaN to integer", naming no file
        (8, "b", 10**30),
        (3, "open", [["step", "one", 1, 2]]),
        (3, "open", "x"),
    ],
)
def test_wrongly_typed_ledger_fields_name_file_and_line(tmp_path, line, field, value):
    two_attempts(tmp_path)
    [first] = [l for l in read_ledgers(str(tmp_path)) if l.attempt == "a1"]
    lines = open(first.source).read().splitlines(keepends=True)
    rec = json.loads(lines[line - 1])
    assert field in rec, (rec, field)
    rec[field] = value
    lines[line - 1] = json.dumps(rec) + "\n"
    open(first.source, "w").write("".join(lines))
    with pytest.raises(
        LedgerError, match=rf"ledger-a1-rank0\.jsonl:{line}: field '{field}' (of a '{rec['k']}' record )?must be"
    ):
        attribute_root(str(tmp_path))


def edit_record(source: str, line: int, field: str, value: object) -> None:
    """Set `field` (``a.step``: a key of the span's attributes) of the record at `line` of the ledger `source`."""
    lines = open(source).read().splitlines(keepends=True)
    rec = json.loads(lines[line - 1])
    *outer, name = field.split(".")
    (rec[outer[0]] if outer else rec)[name] = value
    lines[line - 1] = json.dumps(rec) + "\n"
    open(source, "w").write("".join(lines))


@pytest.mark.parametrize(
    "line, field, value",
    [(8, "k", []), (8, "k", {}), (8, "k", 5), (13, "a", [2]), (13, "a.step", [2]), (13, "a.part", {}), (1, "v", "2")],
)
def test_a_malformed_record_is_one_error_line_naming_file_and_line(tmp_path, capsys, line, field, value):
    """Any field attribution reads, `k` and a save's attributes included: one line, `error: FILE:LINE: ...`, exit 2
    (`{"k": []}` was a TypeError traceback)."""
    source, err = report_after_edit(tmp_path, capsys, line, field, value)
    assert err.startswith(f"error: {source}:{line}: ") and len(err.splitlines()) == 1, err


def report_after_edit(tmp_path, capsys, line: int, field: str, value: object) -> tuple[str, str]:
    """(the edited ledger, stderr) of `python -m ettr report` on `two_attempts` with one field of a1's ledger set,
    which must exit 2."""
    two_attempts(tmp_path)
    [first] = [l for l in read_ledgers(str(tmp_path)) if l.attempt == "a1"]
    edit_record(first.source, line, field, value)
    assert ettr.cli.main(["report", str(tmp_path)]) == 2
    return first.source, capsys.readouterr().err


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("rank", 7, "1: the start record's rank 7 is not the file name's (rank0)"),
        ("rank", -3, "1: the start record's rank -3 is not the file name's (rank0)"),
        ("t", 2_000_000_000, "2: a 'alive' record at t=1000000000, before its attempt's start (t=2000000000)"),
    ],
)
def test_a_record_that_contradicts_its_ledger_is_an_error_naming_file_and_line(tmp_path, capsys, field, value, where):
    """A start record of another rank than the file name's, records dated before the start (a wall time of 0): these
    were reported without a word, as a bad field is not."""
    source, err = report_after_edit(tmp_path, capsys, 1, field, value)
    assert err == f"error: {source}:{where}\n"


class _ProcessClock(FakeClock):
    """A fake clock whose process was born at `born`: trackers date their attempt from there."""

    def __init__(self, born: float) -> None:
        super().__init__(born)
        self._born = self.wall_us()

    def process_age_us(self) -> int:
        return self.wall_us() - self._born


def test_a_second_tracker_in_the_same_process_starts_where_the_first_ended(tmp_path, recwarn):
    clock = _ProcessClock(1000.0)
    clock.advance(2.0)
    tr = attempt(tmp_path, clock, "a1")  # dated from the process start: 2 s of startup
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    tr.end()  # at 1004.5
    clock.advance(5.5)
    tr = attempt(tmp_path, clock, "a2")  # also dated from the process start (1000), which a1 already covers
    restore(tr, clock, 2, 1.0)
    steps(tr, clock, 3, 4, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(startup=7.5, productive=4.0, checkpoint_save=0.5, checkpoint_restore=1.0)
    assert [(at.start_us, at.end_us) for at in a.attempts] == [
        (to_us(1000.0), to_us(1004.5)),
        (to_us(1004.5), to_us(1013.0)),
    ]
    assert not [w for w in recwarn if "clock went back" in str(w.message)]
    check_sum(a)


def test_a_second_tracker_in_the_same_process_exports_the_reports_totals(tmp_path):
    """The second tracker counted its startup from the process start, which the first one's attempt covers: its live
    job totals (ettr.job.time, TrainLoop.ettr()) held 4.5 s more startup than the report (the first attempt's time
    twice over, 17.5 s of a 13 s job), and the windowed ETTR left out the first attempt's productive seconds."""
    clock = _ProcessClock(1000.0)
    clock.advance(2.0)
    tr = attempt(tmp_path, clock, "a1")
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    tr.end()  # at 1004.5
    clock.advance(5.5)
    reader = InMemoryMetricReader()
    metrics = GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("ettr"))
    tr = attempt(tmp_path, clock, "a2", metrics=metrics)  # dated from the process start (1000), as a1 is
    restore(tr, clock, 2, 1.0)
    steps(tr, clock, 3, 4, 1.0)
    tr.flush()
    a = attribute_root(str(tmp_path))
    assert a.micros == expected(startup=7.5, productive=4.0, checkpoint_save=0.5, checkpoint_restore=1.0)
    assert {c: us for c, us in tr.totals_us().items() if us} == {c: us for c, us in a.micros.items() if us}
    exported = metric_totals(reader)
    assert exported["seconds"] == {c: s for c, s in a.seconds.items() if s}
    assert exported["ettr"] == {"cumulative": 4.0 / 13.0, "3600s": 4.0 / 13.0}
    assert exported["attempt_seconds"]["startup"] == 10.0  # the attempt's own view: from its process's start
    tr.end()


def test_two_attempts_recording_at_once_are_named_in_a_warning(tmp_path):
    """Two processes of rank 0 on one root at once (a second job started there by mistake): the first one's steps after
    the second one's start vanished and all of them counted as lost, both attempts 'ok', without a word. Now the
    report warns, and so does the second job's tracker when it reads the earlier ledgers."""
    warning = (
        r"attempt a2 \(.*ledger-a2-rank0.jsonl\) began recording 4.500 s before attempt a1 .* two processes of rank 0"
    )
    first, second = FakeClock(1000.0), FakeClock(1000.0)
    with pytest.warns(RuntimeWarning, match=warning):
        one = attempt(tmp_path, first, "a1")
        steps(one, first, 1, 3, 1.0)  # to 1003
        second.set(1001.5)
        two = attempt(tmp_path, second, "a2")
        steps(one, first, 4, 6, 1.0)  # a1 goes on to 1006
        steps(two, second, 1, 3, 1.0)
        one.end()
        two.end()
    with pytest.warns(RuntimeWarning, match=warning):
        a = attribute_root(str(tmp_path))
    check_sum(a)


def test_a_second_job_whose_process_started_first_is_counted_from_the_first_jobs_start(tmp_path):
    """Two jobs started on one root at once, the second one's process 0.5 s before the first one's (its imports took
    longer, so its tracker began recording later): the first attempt was counted up to the second one's process
    start, before its own start (end_us < start_us), and the categories summed to 7.5 s of a 6.5 s job."""
    first, second = _ProcessClock(1000.5), _ProcessClock(1000.0)
    first.advance(0.5)
    one = attempt(tmp_path, first, "a1")  # dated from its process start, 1000.5
    steps(one, first, 1, 3, 1.0)  # to 1004
    second.set(1002.0)
    with pytest.warns(RuntimeWarning, match="two processes of rank 0"):
        two = attempt(tmp_path, second, "a2")  # dated from its process start, 1000.0
        steps(two, second, 1, 5, 1.0)  # to 1007
    one.end()
    two.end()
    with pytest.warns(RuntimeWarning, match="two processes of rank 0"):
        a = attribute_root(str(tmp_path))
    assert [(at.start_us, at.end_us) for at in a.attempts] == [(to_us(1000.5),) * 2, (to_us(1000.5), to_us(1007.0))]
    assert a.micros == expected(startup=1.5, productive=5.0)
    check_sum(a)


class _TickClock(_ProcessClock):
    """As Linux tells a process's age (SystemClock: /proc, in clock ticks of 10 ms): the age read at x.004 s is
    cut to x.000, so the process start it dates an attempt from wobbles by up to 10 ms from one reading to the next."""

    def process_age_us(self) -> int:
        return self.wall_us() // 10_000 * 10_000 - self._born


def test_two_trackers_of_one_process_are_reported_in_the_order_they_ran(tmp_path, recwarn):
    """The second tracker's process start read 8 ms earlier than the first's (1000.001 vs 1000.009 s): the report put
    it first, ahead of the attempt it followed, and its steps vanished (2 s productive of 4). With SystemClock this
    happened to 15 of 20 pairs of trackers run one after the other (a second train() or fit() in one process)."""
    clock = _TickClock(1000.0)
    clock.advance(2.009)
    tr = attempt(tmp_path, clock, "a1")
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    tr.end()  # at 1004.509
    clock.advance(0.492)  # 1005.001
    tr = attempt(tmp_path, clock, "a2")  # a second phase of training, from the step the first one committed
    steps(tr, clock, 3, 4, 1.0)
    tr.end()
    assert [l.records[0]["t"] for l in read_ledgers(str(tmp_path))] == [to_us(1000.009), to_us(1000.001)]
    a = attribute_root(str(tmp_path))
    assert [(at.attempt, at.first_step, at.status) for at in a.attempts] == [("a1", 1, "ok"), ("a2", 3, "ok")]
    assert a.micros == expected(startup=2.492, productive=4.0, checkpoint_save=0.5)  # a1 dated from 1000.009
    assert a.attempts[1].start_us == a.attempts[0].end_us == to_us(1004.509)
    assert not [w for w in recwarn if "clock went back" in str(w.message)]
    check_sum(a)


def test_restores_per_tier_and_failure_classes(tmp_path):
    """A two-tier job, four attempts: a crash the local tier survives (restored from it), a node loss (restored from
    the durable tier although the local tier held a newer step), a loss a peer replica covered; restore seconds and
    counts per tier, and each failure's class, exactly."""
    clock = FakeClock(1000.0)

    def commit(tr, step, tier):
        save(tr, clock, step, 0.5)
        tr.checkpoint_committed(step, 0.25, tier=tier)

    def restore_from(tr, step, seconds, tier):
        with tr.span("checkpoint_restore"):
            clock.advance(seconds)
        tr.checkpoint_restored(step, tier=tier)

    tr = attempt(tmp_path, clock, "a1")
    restore_from(tr, None, 0.5, None)  # fresh start: nothing restored, no tier
    steps(tr, clock, 1, 2, 1.0)
    commit(tr, 2, "local")
    tr.checkpoint_committed(2, 3.0, tier="durable")  # the persist of step 2
    steps(tr, clock, 3, 4, 1.0)
    commit(tr, 4, "local")
    steps(tr, clock, 5, 5, 1.0)  # process crash
    tr = attempt(tmp_path, clock, "a2", at=1020.0)
    restore_from(tr, 4, 1.0, "local")
    steps(tr, clock, 5, 6, 1.0)
    commit(tr, 6, "local")
    steps(tr, clock, 7, 7, 1.0)  # node lost: local step 6 gone with it
    tr = attempt(tmp_path, clock, "a3", at=1040.0)
    restore_from(tr, 2, 4.0, "durable")
    steps(tr, clock, 3, 4, 1.0)
    commit(tr, 4, "local")
    steps(tr, clock, 5, 5, 1.0)  # node lost again, its shard restored from the peer replica
    tr = attempt(tmp_path, clock, "a4", at=1060.0)
    restore_from(tr, 4, 2.0, "peer")
    steps(tr, clock, 5, 6, 1.0)
    tr.end()
    a = attribute_root(str(tmp_path))
    assert [at.restored_tier for at in a.attempts] == [None, "local", "durable", "peer"]
    assert [at.failure_class for at in a.attempts] == ["local", "node", "local", None]
    assert a.failure_classes == {"local": 2, "node": 1, "unclassified": 0}
    assert a.restores_per_tier == {"local": (1, 1.0), "durable": (1, 4.0), "peer": (1, 2.0)}
    assert a.micros == expected(checkpoint_restore=7.5, checkpoint_save=2.0, productive=6.0, lost=7.0, downtime=41.5)
    check_sum(a)
    d = a.to_dict()
    assert d["restores_per_tier"] == {
        "local": {"restores": 1, "seconds": 1.0},
        "durable": {"restores": 1, "seconds": 4.0},
        "peer": {"restores": 1, "seconds": 2.0},
    }
    assert d["failure_classes"] == {"local": 2, "node": 1, "unclassified": 0}
    assert [x["restored_tier"] for x in d["attempts"]] == [None, "local", "durable", "peer"]


def test_a_durable_restore_is_a_node_loss_only_with_a_local_step_at_least_as_new(tmp_path):
    """One-tier ledgers (no tier anywhere) and a durable restore of the newest step without local commits tell
    nothing: unclassified; old ledgers read as before."""
    two_attempts(tmp_path)
    a = attribute_root(str(tmp_path))
    assert a.failure_classes == {"local": 0, "node": 0, "unclassified": 1}
    assert a.restores_per_tier == {None: (1, 1.0)} and a.attempts[1].restored_tier is None
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path / "b", clock, "a1")
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5)
    tr.checkpoint_committed(2, 0.5, tier="durable")
    tr = attempt(tmp_path / "b", clock, "a2", at=1010.0)
    tr.checkpoint_restored(2, tier="durable")
    tr.end()
    assert attribute_root(str(tmp_path / "b")).failure_classes == {"local": 0, "node": 0, "unclassified": 1}


def test_a_tier_is_named_or_the_record_is_refused(tmp_path):
    clock = FakeClock(1000.0)
    tr = attempt(tmp_path, clock, "a1")
    with pytest.raises(ValueError, match="tier must be one of local, peer, durable or None, got 'nvme'"):
        tr.checkpoint_restored(None, tier="nvme")
    tr.checkpoint_restored(None, tier="local")
    tr.end()
    [ledger] = read_ledgers(str(tmp_path))
    lines = open(ledger.source).read().splitlines(keepends=True)
    line = next(i for i, text in enumerate(lines, 1) if '"tier"' in text)
    lines[line - 1] = lines[line - 1].replace('"local"', "7")
    open(ledger.source, "w").write("".join(lines))
    with pytest.raises(
        LedgerError, match=rf"ledger-a1-rank0\.jsonl:{line}: field 'tier' of a 'restore' record must be"
    ):
        attribute_root(str(tmp_path))


def _crashing_job(root, attempts: int) -> list:
    """`attempts` attempts of 3 one-second steps each, every one but the last killed after committing its second
    step, the next one restoring it (the usual job that crashes a lot)."""
    clock, step = FakeClock(1000.0), 0
    for i in range(attempts):
        tr = attempt(root, clock, f"a{i:05d}")
        if i:
            restore(tr, clock, step, 0.5)
        for j in range(3):
            step += 1
            steps(tr, clock, step, step, 1.0)
            if j == 1:
                save(tr, clock, step, 0.25, bg=1.0)
        step -= 1  # the kill: the next attempt resumes from the committed step
        clock.advance(5.0)
    return read_ledgers(str(root))


def _python_calls(fn) -> int:
    """Python-level function calls made by fn() (a count, not a time: the same on any machine and load)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_attributing_many_restarts_grows_linearly_with_the_attempts(tmp_path):
    """Ordering the attempts compared them field by field (dataclass equality, in list.index): the work grew with the
    square of the attempts, a 4,000-attempt report took 56 s (0.5 s for 1,000 after the fix, 2.3 s for 4,000)."""
    small, large = _crashing_job(tmp_path / "small", 50), _crashing_job(tmp_path / "large", 200)
    a = attribute(large)
    assert a.failures == 199 and a.micros["lost"] == to_us(199.0)
    check_sum(a)
    ratio = _python_calls(lambda: attribute(large)) / _python_calls(lambda: attribute(small))
    assert ratio < 6, f"4x the attempts made {ratio:.1f}x the calls"  # linear: ~4; the old code: ~16


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_follower_answers_as_attribute_root_at_every_point_of_a_job(tmp_path, where):
    """RootFollower, what an advisor asks after every save: at each point of a job (a crash without an end record,
    an end by an error, a live attempt that goes on, a later attempt whose start from scratch makes the steps of those
    before it lost) the same attribution as attribute_root, though it reads an ended attempt's ledger only once."""
    root = str(tmp_path) if where == "local" else "memory://ettr-follower"
    follower, clock = RootFollower(root), FakeClock(1000.0)

    def same() -> None:
        assert follower.attribute() == attribute_root(root)

    tr = attempt(root, clock, "a1")
    restore(tr, clock, None, 0.5)
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    same()
    steps(tr, clock, 3, 5, 1.0)  # then killed: no end record
    tr = attempt(root, clock, "a2", at=1100.0)
    restore(tr, clock, 2, 1.0)
    same()
    steps(tr, clock, 3, 4, 1.0)
    save(tr, clock, 4, 0.5, bg=1.0)
    steps(tr, clock, 5, 6, 1.0)
    same()
    tr.end("error")
    tr = attempt(root, clock, "a3", at=1200.0)
    restore(tr, clock, None, 1.0)  # from scratch: every step of a1 and a2 is lost now
    for s in (1, 3):
        steps(tr, clock, s, s + 1, 1.0)
        save(tr, clock, s + 1, 0.5, bg=1.0)
        same()
    # a2's steps 3-6, and a1's 1-5 as far as they reached the store (an object store's last minute of steps waits)
    assert follower.attribute().micros["lost"] == to_us(4.0 + (2.0 if where == "memory" else 5.0))


def test_a_follower_reads_the_ledger_of_an_ended_attempt_once(tmp_path):
    """The ledger of an attempt that ended is not read again: replaced by garbage after the first call, the answers
    stay those of its first content; the live attempt's ledger is read again at each call."""
    root = str(tmp_path)
    two_attempts(root)  # a1 killed, a2 ended
    clock = FakeClock(1200.0)
    tr = attempt(root, clock, "a3")
    restore(tr, clock, 8, 1.0)
    follower = RootFollower(root)
    follower.attribute()
    ended = [tmp_path / "ettr" / f"ledger-{a}-rank0.jsonl" for a in ("a1", "a2")]
    kept = [p.read_bytes() for p in ended]
    for p in ended:
        p.write_text("not a\nledger\n")
    with pytest.raises(LedgerError, match="not a JSON record"):
        attribute_root(root)  # garbage indeed
    steps(tr, clock, 9, 10, 1.0)
    save(tr, clock, 10, 0.5, bg=1.0)
    now = follower.attribute()
    for p, data in zip(ended, kept):
        p.write_bytes(data)
    assert now == attribute_root(root) and now.attempts[-1].last_step == 10
    live = tmp_path / "ettr" / "ledger-a3-rank0.jsonl"
    live.write_text(live.read_text() + "not a record\n{}\n")
    with pytest.raises(LedgerError, match=r"ledger-a3-rank0.jsonl:\d+: not a JSON record"):
        follower.attribute()
    ended[0].unlink()  # a ledger deleted is left out, as attribute_root leaves it
    live.write_text("".join(live.read_text().splitlines(keepends=True)[:-2]))
    assert follower.attribute() == attribute_root(root) and len(attribute_root(root).attempts) == 2


def test_a_follower_answers_as_attribute_root_for_attempts_moved_on_the_timeline(tmp_path, recwarn):
    """Attempts that attribution moves (a second tracker of one process starts where the first ended, a wall clock
    that went back is placed after the attempt it resumed from) are placed anew at each call: what a follower kept
    for an attempt as placed before is not taken for another placement."""
    root, follower = str(tmp_path), RootFollower(str(tmp_path))
    clock = _ProcessClock(1000.0)
    clock.advance(2.0)
    tr = attempt(tmp_path, clock, "a1")
    steps(tr, clock, 1, 2, 1.0)
    save(tr, clock, 2, 0.5, bg=1.0)
    tr.end()
    clock.advance(5.5)
    tr = attempt(tmp_path, clock, "a2")  # dated from the process start, which a1 covers
    restore(tr, clock, 2, 1.0)
    steps(tr, clock, 3, 4, 1.0)
    save(tr, clock, 4, 0.5, bg=1.0)
    assert follower.attribute() == attribute_root(root)
    steps(tr, clock, 5, 6, 1.0)  # then killed
    clock = FakeClock(900.0)  # the next node's wall clock is behind
    tr = attempt(tmp_path, clock, "a3")
    restore(tr, clock, 4, 1.0)
    for s in (5, 7):
        steps(tr, clock, s, s + 1, 1.0)
        save(tr, clock, s + 1, 0.5, bg=1.0)
        assert follower.attribute() == attribute_root(root)
    assert [at.attempt for at in attribute_root(root).attempts] == ["a1", "a2", "a3"]
