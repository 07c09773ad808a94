"""GoodputTracker with real processes: what reaches the ledger before a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ettr import CATEGORIES, FakeClock, GoodputTracker, attribute_root
from ettr.clock import to_us

REPO = Path(__file__).resolve().parents[1]

# One attempt on a fake clock starting at START s: a 0.5 s restore of nothing, then STEPS steps of 0.1 s each, all
# within one flush interval (1 s); then it ends cleanly, or waits to be SIGKILLed.
CHILD = r"""
import sys, time
from ettr import FakeClock, GoodputTracker
root, attempt, start, steps, then = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
clock = FakeClock(start)
tracker = GoodputTracker(root, attempt_id=attempt, rank=0, job_id="job", clock=clock).start()
with tracker.span("checkpoint_restore"):
    clock.advance(0.5)
tracker.checkpoint_restored(None)
for step in range(1, steps + 1):
    tracker.step_begin(step)
    clock.advance(0.1)
    tracker.step_end(step)
if then == "end":
    tracker.end()
    sys.exit()
print("hanging", flush=True)
time.sleep(600)
"""


def attempt(script, root, name: str, start: float, steps: int, then: str) -> subprocess.Popen:
    """Run one attempt of the child."""
    return subprocess.Popen(
        [sys.executable, str(script), str(root), name, str(start), str(steps), then],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_steps_before_a_sigkill_are_lost_work_not_downtime(tmp_path):
    script, root, steps = tmp_path / "child.py", tmp_path / "run", 6
    script.write_text(CHILD)
    proc = attempt(script, root, "a1", 1000.0, steps, "hang")
    assert proc.stdout.readline() == "hanging\n"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    # the restart, 9.1 s after the last step ended, resumes from scratch
    assert attempt(script, root, "a2", 1010.0, steps, "end").wait(timeout=60) == 0

    a = attribute_root(str(root))
    summary = [(at.status, at.last_step, at.lost_steps) for at in a.attempts]
    assert summary == [("failed", steps, steps), ("ok", steps, 0)]
    want = {
        "checkpoint_restore": 1.0,
        "lost": steps * 0.1,
        "downtime": 10.0 - 0.5 - steps * 0.1,
        "productive": steps * 0.1,
    }
    assert a.micros == {c: to_us(want.get(c, 0.0)) for c in CATEGORIES}


# -- arguments refused at the call, before anything reaches the ledger ----------------------------------------------


def ledger_text(root: Path) -> str:
    """The one ledger under `root` as written."""
    (path,) = (root / "ettr").glob("ledger-*.jsonl")
    return path.read_text()


def test_a_span_category_that_is_not_a_string_is_refused_and_the_job_keeps_its_report(tmp_path):
    """span(None) and span(3) were accepted: span(3) wrote `"o":1{}}` (taken for a step record), span(None) a record
    the reader refuses, and the whole job's report was lost. Now the call raises and nothing bad is written."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    for category, kind in ((None, TypeError), (3, TypeError), (b"eval", TypeError), ("", ValueError)):
        with pytest.raises(
            kind, match=f"span category must be a non-empty string|must be a string, got .*{category!r}"
        ):
            with tr.span(category):
                clock.advance(1.0)
    tr.step_begin(1)
    clock.advance(2.0)
    tr.step_end(1)
    tr.end()
    assert '"c":null' not in ledger_text(tmp_path) and "}}" not in ledger_text(tmp_path)
    assert attribute_root(str(tmp_path)).seconds["productive"] == 2.0
    out = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(tmp_path)], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr


def test_span_attributes_must_be_json_numpy_scalars_and_0d_tensors_become_numbers(tmp_path):
    """An attribute json cannot write was accepted, its record silently dropped, and the next step_end raised
    `Object of type int64 is not JSON serializable`, naming neither. Now: numpy scalars and 0-d tensors become numbers
    (as in ckpt's save metadata), anything else is refused at the call naming the attribute and its value."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    with pytest.raises(TypeError, match=r"span attribute model= must be JSON .* got object <object"):
        tr.span("eval", model=object())
    with pytest.raises(TypeError, match=r"span attribute w= must be JSON .* got ndarray"):
        tr.span("eval", w=np.zeros(3))
    with pytest.raises(ValueError, match=r"span attribute loss= must be JSON \(finite numbers.* got float nan"):
        tr.span("eval", loss=float("nan"))
    tags = ["a"]
    with tr.span("eval", epoch=np.int64(3), loss=torch.tensor(0.5), lr=np.float32(0.25), tags=tags, n={"k": 1}):
        tags.append("b")  # the record holds the attributes as they were at the call
        clock.advance(1.0)
    tr.step_begin(1)
    clock.advance(2.0)
    tr.step_end(1)  # raised a TypeError from json here
    tr.end()
    (span,) = [r for r in map(json.loads, ledger_text(tmp_path).splitlines()) if r["k"] == "span"]
    assert span["c"] == "eval" and span["a"] == {"epoch": 3, "loss": 0.5, "lr": 0.25, "tags": ["a"], "n": {"k": 1}}
    assert attribute_root(str(tmp_path)).seconds["eval"] == 1.0


def test_steps_and_hook_arguments_must_be_integers_and_seconds(tmp_path):
    """step_begin("a") raised `unsupported operand type(s) for //: 'str' and 'int'`; now every recording method names
    the argument. numpy integers and 0-d integer tensors are steps (as ints in the ledger)."""
    np = pytest.importorskip("numpy")
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    for call in (
        lambda: tr.step_begin("a"),
        lambda: tr.step_end("a"),
        lambda: tr.step(1.5),
        lambda: tr.step_begin(True),
        lambda: tr.checkpoint_committed("3", 1.0),
        lambda: tr.checkpoint_restored(2.0),
        lambda: tr.checkpoint_deleted(None),
        lambda: tr.checkpoint_failed("x", RuntimeError()),
    ):
        with pytest.raises(TypeError, match="step must be an integer, got"):
            call()
    with pytest.raises(ValueError, match="background_seconds must be a finite non-negative number of seconds"):
        tr.checkpoint_committed(3, -1.0)
    with pytest.raises(ValueError, match="nbytes must be a non-negative integer or None, got -5"):
        tr.checkpoint_committed(3, 1.0, -5)
    # what the ledger's reader refuses is refused at the call: one such record cost the whole job's report
    for call, shown in (
        (lambda: tr.step(2**63), "9223372036854775808"),
        (lambda: tr.step_begin(-(2**63)), "-9223372036854775808"),
        (lambda: tr.checkpoint_committed(np.uint64(2**64 - 1), 1.0), "18446744073709551615"),
        (lambda: tr.step(10**5000), "int holding an int of over 4,300 digits"),
    ):
        with pytest.raises(ValueError, match=f"step must be a 64-bit integer .* got .*{shown}"):
            call()
    for value in (10**5000, [10**5000]):
        with pytest.raises(ValueError, match="span attribute n= must be JSON .* over 4,300 digits"):
            tr.span("eval", n=value)
    with pytest.raises(TypeError, match="status must be a string"):
        tr.end(None)
    with tr.step(np.int64(1)):
        clock.advance(1.0)
    tr.checkpoint_committed(np.int64(1), np.float64(0.5), np.int64(10))
    tr.end()
    records = [json.loads(line) for line in ledger_text(tmp_path).splitlines()]
    assert [(r["k"], r["s"]) for r in records if "s" in r] == [("step", 1), ("commit", 1)]


@pytest.mark.parametrize(
    "args, kind, message",
    [
        ((None,), TypeError, "root must be a path or URL .* got NoneType None"),
        ((5,), TypeError, "root must be a path or URL .* got int 5"),
        (("",), ValueError, "root must be a path or URL, got ''"),
        (("r", {"flush_interval": -1}), ValueError, "flush_interval must be a finite non-negative .* got -1"),
        (("r", {"window_s": 0}), ValueError, "window_s must be a finite positive number of seconds, .* got 0"),
        (("r", {"window_s": 1e308}), ValueError, "window_s .* at most 1e\\+10 \\(317 years\\), got 1e\\+308"),
        (("r", {"window_s": True}), ValueError, "window_s must be a finite positive number of seconds, .* got True"),
        (("r", {"window_s": 1e-9}), ValueError, "window_s must be at least 1e-06 s \\(a microsecond.*got 1e-09"),
        (("r", {"upload_interval": float("nan")}), ValueError, "upload_interval must be a finite"),
        (("r", {"rank": -1}), ValueError, "rank must be a non-negative integer, got -1"),
        (("r", {"rank": "0"}), TypeError, "rank must be an integer, got str '0'"),
        (("r", {"job_id": 7}), TypeError, "job_id must be a string or None, got int 7"),
        (("r", {"attempt_id": "a/b"}), ValueError, "attempt_id names a ledger file and cannot hold '/'"),
        # a ledger with a newline in its name was listed by no report; a NUL failed start() in os.open
        (("r", {"attempt_id": "a\nb"}), ValueError, r"cannot hold '/' or control characters .* got 'a\\nb'"),
        (("r", {"attempt_id": "a\x00b"}), ValueError, r"cannot hold '/' or control characters .* got 'a\\x00b'"),
        (("r", {"storage_options": "k=v"}), TypeError, "storage_options must be a dict or None, got str"),
        (("r", {"straggler_window": "a"}), TypeError, "straggler_window must be an integer, got str 'a'"),
    ],
)
def test_constructor_arguments_are_checked_at_construction(args, kind, message):
    """GoodputTracker(None) or (5) was accepted and start() raised a TypeError from fsspec; flush_interval=-1 was
    accepted. Now construction refuses them, naming the argument and the value."""
    with pytest.raises(kind, match=message):
        GoodputTracker(*args[:1], **(args[1] if len(args) > 1 else {}))


@pytest.mark.parametrize("value", ["-1", "abc", ""])
def test_a_rank_variable_that_is_no_rank_is_refused_naming_it(tmp_path, monkeypatch, value):
    """RANK=-1 was taken as rank -1: the ledger ledger-<id>-rank-1.jsonl was one no report reads ('no ledgers in');
    RANK=abc was int()'s "invalid literal ... 'abc'", naming no variable."""
    monkeypatch.setenv("RANK", value)
    with pytest.raises(ValueError, match=f"RANK={value!r} in the environment is no rank .* pass rank="):
        GoodputTracker(tmp_path)
    assert not (tmp_path / "ettr").exists()
    monkeypatch.setenv("RANK", "3")
    assert GoodputTracker(tmp_path).rank == 3


def test_a_pathlike_root_is_a_path(tmp_path):
    """A pathlib.Path root (os.PathLike) is its path: it made the start record unwritable before."""
    tr = GoodputTracker(tmp_path, attempt_id="a1", rank=0, clock=FakeClock(1000.0)).start()
    tr.end()
    assert tr.root == str(tmp_path) and attribute_root(str(tmp_path)).attempts[0].status == "ok"


def test_recording_before_start_is_a_clear_error(tmp_path):
    """A step, span or end before start() says to call start(), not an AttributeError of the tracker's insides."""
    tracker = GoodputTracker(str(tmp_path))
    for record in (lambda: tracker.step_begin(1), lambda: tracker.span("eval").__enter__(), tracker.end):
        with pytest.raises(RuntimeError, match=r"records nothing before start\(\)"):
            record()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_second_process_given_the_same_attempt_id_is_its_own_attempt(tmp_path, caplog, where):
    """A requeued job that passes its scheduler's id as attempt_id again: the second process used to append to the
    first one's ledger (one attempt with two starts: the crash's lost work and the downtime vanished into 1,000 s
    of start-up). It is recorded as '<id>.2', with a warning, and the time between the two is attributed."""
    import uuid

    root = str(tmp_path) if where == "local" else f"memory://{uuid.uuid4().hex}/run"
    for start, crashed in ((1000.0, True), (2000.0, False)):
        clock = FakeClock(start)
        tracker = GoodputTracker(
            root, attempt_id="slurm-42", rank=0, job_id="job", clock=clock, upload_interval=0
        ).start()
        for step in (1, 2, 3):
            tracker.step_begin(step)
            clock.advance(1.0)
            tracker.step_end(step)
        if crashed:
            tracker.flush()  # then the process dies: no end()
        else:
            tracker.end()
    assert tracker.attempt_id == "slurm-42.2"
    assert "has a ledger already" in caplog.text and "'slurm-42.2'" in caplog.text
    micros = attribute_root(root).micros
    assert micros["productive"] == to_us(3.0) and micros["lost"] == to_us(3.0)
    assert micros["downtime"] == to_us(997.0) and micros["startup"] == 0


def test_a_refused_digest_ends_its_step_and_never_hides_the_steps_own_error(tmp_path):
    """A loss that is no number (or scalars that are none) is refused at the step's end, and the step still ends:
    it stayed open, so every gap after it counted as productive. A step whose body raised ends without its digest:
    the refusal replaced the body's own error (a CUDA out-of-memory seen as 'loss must be a number')."""
    clock = FakeClock()
    tracker = GoodputTracker(str(tmp_path), job_id="J", clock=clock).start()
    tracker.checkpoint_restored(None)
    with pytest.raises(TypeError, match="loss must be a number"):
        with tracker.step(1) as step:
            clock.advance(1)
            step.record("n/a")
    with pytest.raises(TypeError, match="scalars must be a dict of numbers"):
        with tracker.step(2) as step:
            clock.advance(1)
            step.record(0.5, scalars={"acc": "high"})
    with pytest.raises(RuntimeError, match="out of memory"):
        with tracker.step(3) as step:
            clock.advance(1)
            step.record([1.0, 2.0])
            raise RuntimeError("CUDA out of memory")
    clock.advance(10)  # outside any step
    with tracker.step(4):
        clock.advance(1)
    tracker.end()
    seconds = {k: v for k, v in attribute_root(str(tmp_path)).seconds.items() if v}
    assert seconds["productive"] == pytest.approx(4.0) and seconds["other"] == pytest.approx(10.0), seconds


def test_every_record_after_end_is_refused_and_the_totals_stay_at_the_end(tmp_path):
    """After end() a step's begin, a span (a loader's data_wait during an evaluation after training) and a delete
    were accepted and kept in memory for a flush that never came: lost in silence, and memory grew with every
    one. Each is refused at its call naming the closed ledger, as a commit is, and so is a second end(); the live
    totals (TrainLoop.ettr()) stay those of the end instead of counting the time after it as 'other'."""
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    tracker.checkpoint_restored(None)
    with tracker.step(1):
        clock.advance(1.0)
    tracker.end()
    totals = tracker.totals_us()
    clock.advance(60.0)
    for record in (
        lambda: tracker.step_begin(2),
        lambda: tracker.span("data_wait").__enter__(),
        lambda: tracker.checkpoint_deleted(1),
        tracker.end,
    ):
        with pytest.raises(ValueError, match=r"ledger-a1-rank0: the ledger is closed"):
            record()
    assert tracker.totals_us() == totals and totals["productive"] == to_us(1.0)
    text = (tmp_path / "ettr" / "ledger-a1-rank0.jsonl").read_text()
    kinds = [json.loads(line)["k"] for line in text.splitlines()]
    assert kinds.count("end") == 1 and "delete" not in kinds and "span" not in kinds


def test_a_forked_child_records_nothing_into_its_parents_ledger_nor_exports_its_checkpoint(tmp_path):
    """A forked child (a DataLoader worker, a multiprocessing.Process) holds a copy of its parent's tracker. Its
    steps, spans and end record went into the parent's ledger between the parent's own (orders the parent had
    given, an 'ok' end in the middle), read by every report without a word; and its copy of the SDK exported the
    parent's last checkpoint step frozen at the fork with an age growing beside the parent's, in the same series
    (an age alert fired from a DataLoader worker). In the child every record is refused naming both processes, and
    the checkpoint gauges report nothing."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from ettr import GoodputMetrics, metric_totals

    reader = InMemoryMetricReader()
    metrics = GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("ettr"))
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(
        str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock, metrics=metrics, flush_interval=0
    ).start()
    tracker.checkpoint_restored(None)
    with tracker.step(1):
        clock.advance(1.0)
    tracker.checkpoint_committed(1, 0.5)
    assert metric_totals(reader)["last_step"] == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it saw through the pipe, whatever happens
        try:
            seen = metric_totals(reader)
            errors = []
            for record in (
                lambda: tracker.step_begin(2),
                lambda: tracker.span("eval").__enter__(),
                lambda: tracker.checkpoint_committed(2, 0.5),
                tracker.end,
            ):
                try:
                    record()
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
            os.write(write, json.dumps({"gauges": sorted({"last_step", "age"} & set(seen)), "errors": errors}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read() or "null")
    os.waitpid(pid, 0)
    with tracker.step(2):
        clock.advance(1.0)
    tracker.end()
    assert child is not None and child["gauges"] == []
    for error in child["errors"]:
        assert error and f"the ledger of process {os.getpid()}" in error and "is a fork of it" in error, error
    records = [json.loads(line) for line in (tmp_path / "ettr" / "ledger-a1-rank0.jsonl").read_text().splitlines()]
    assert [r["s"] for r in records if r["k"] == "step"] == [1, 2]
    assert [r["k"] for r in records].count("end") == 1 and not any(r["k"] == "span" for r in records)
    assert [r["s"] for r in records if r["k"] == "commit"] == [1]
