"""Per-rank step times, the step-time deviation and the slowest rank per window, on scripted ledgers of three ranks
(a fake clock, real ledgers, a real OpenTelemetry in-memory reader) and through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from ettr import (
    FakeClock,
    GoodputMetrics,
    GoodputTracker,
    ideal_step,
    metric_totals,
    read_ledgers,
    step_deviation,
    stragglers,
    stragglers_root,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 10
# Each rank's own (busy) seconds per step, steps 0-19; in every step each rank then waits at the collective for the
# slowest one, so every rank's step lasts as long as the step's slowest busy time.
BUSY = {
    0: [1.0] * 20,
    1: [1.0] * 10 + [2.0] * 5 + [1.0] * 5,
    2: [1.5] * 10 + [1.2] * 10,
}


def lockstep(root: str, attempt: str, at: float, steps: range, busy: dict[int, list[float]], end: bool) -> list:
    """Run `steps` on the three ranks at once from `at` (each a tracker on its own fake clock and metrics reader),
    resuming from the step before the first; end cleanly if `end`, else vanish (a crash). Returns the readers."""
    readers, trackers, clocks = [], [], []
    for rank in busy:
        reader = InMemoryMetricReader()
        clock = FakeClock(at)
        metrics = GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
        tracker = GoodputTracker(
            root,
            job_id="job",
            attempt_id=f"{attempt}-r{rank}",
            rank=rank,
            clock=clock,
            flush_interval=600.0,
            straggler_window=WINDOW,
            metrics=metrics,
        ).start()
        tracker.checkpoint_restored(steps[0] - 1 if steps[0] else None)
        readers.append(reader)
        trackers.append(tracker)
        clocks.append(clock)
    for s in steps:
        slowest = max(busy[rank][s] for rank in busy)
        for rank, tracker, clock in zip(busy, trackers, clocks):
            tracker.step_begin(s)
            clock.advance(busy[rank][s])
            with tracker.span("collective_wait"):
                clock.advance(slowest - busy[rank][s])
            tracker.step_end(s)
    for tracker in trackers:
        tracker.end() if end else tracker.flush()
    return readers


@pytest.fixture
def job(tmp_path) -> tuple[str, list, list]:
    """Attempt a: steps 0-12, rank 0 slow (9 s) in steps 10-12, then a crash; attempt b resumes from step 9 and runs
    steps 10-19 as BUSY says. Each step's last run counts, so the result is BUSY's."""
    root = str(tmp_path)
    crashed = {
        rank: [*times[:10], 9.0 if rank == 0 else 1.0, 9.0 if rank == 0 else 1.0, 9.0 if rank == 0 else 1.0]
        for rank, times in BUSY.items()
    }
    first = lockstep(root, "a", 1000.0, range(0, 13), crashed, end=False)
    second = lockstep(root, "b", 2000.0, range(10, 20), BUSY, end=True)
    return root, first, second


# Worked out by hand from BUSY. Every rank's step lasts the step's slowest busy time: 1.5 s in steps 0-9, 2.0 s in
# 10-14, 1.2 s in 15-19 (31 s in all). Sorted, the 20 step times are 5 x 1.2, 10 x 1.5, 5 x 2.0: median 1.5; the
# |t - 1.5| are 10 x 0, 5 x 0.3, 5 x 0.5: MAD 0.15; median + 3 MAD = 1.95 leaves out the 2.0 s steps, so the ideal
# step time is (10 x 1.5 + 5 x 1.2) / 15 = 1.4 s. Fewer than 100 steps: the deviation is the mean |t - 1.4| =
# (10 x 0.1 + 5 x 0.6 + 5 x 0.2) / 20 = 0.25 s. Busy: 20, 25, 27 s; collective waits: 31 s less each.
RANKS = [
    {
        "rank": r,
        "steps": 20,
        "step_seconds": 31.0,
        "busy_seconds": busy,
        "collective_wait_seconds": 31.0 - busy,
        "ideal_step_seconds": 1.4,
        "step_time_deviation_seconds": 0.25,
    }
    for r, busy in ((0, 20.0), (1, 25.0), (2, 27.0))
]
# Window steps 0-9: busy 10, 10, 15 -> rank 2, the others' median 10: 5 s waited for it. Steps 10-19: busy 10, 15,
# 12 -> rank 1, the others' median (10 + 12) / 2 = 11: 4 s.
WINDOWS = [
    {"first_step": 0, "last_step": 9, "steps": 10, "slowest_rank": 2, "slowest_busy_seconds": 15.0,
     "others_busy_seconds": 10.0, "waited_seconds": 5.0},
    {"first_step": 10, "last_step": 19, "steps": 10, "slowest_rank": 1, "slowest_busy_seconds": 15.0,
     "others_busy_seconds": 11.0, "waited_seconds": 4.0},
]  # fmt: skip


def test_ranks_windows_and_waiting_on_a_fake_clock(job):
    root, _, _ = job
    s = stragglers_root(root, window=WINDOW)
    out = s.to_dict()
    assert out["ranks"] == RANKS
    assert out["windows"] == WINDOWS
    assert (out["waited_seconds"], out["waited_seconds_per_rank"], out["slowest_rank"]) == (
        9.0,
        {"1": 4.0, "2": 5.0},
        2,
    )
    # the same ledgers read as one rank's: per-rank numbers, no window to compare
    alone = stragglers([l for l in read_ledgers(root) if l.rank == 1], window=WINDOW)
    assert alone.windows == () and alone.slowest_rank is None and alone.ranks == s.ranks[1:2]


def test_each_rank_exports_its_window_busy_and_wait_time(job):
    """Each tracker sets its last complete window when the next one's first step ends (attempt a: steps 0-9), and the
    window in progress at end() (attempt b: steps 10-19): the slowest rank's busy gauge is the highest."""
    _, first, second = job
    seen = [metric_totals(r) for r in first]
    assert [(m["step_window_first_step"], m["step_window_steps"]) for m in seen] == [(0, 10)] * 3
    assert [m["step_window"] for m in seen] == [
        {"busy": 10.0, "collective_wait": 5.0},
        {"busy": 10.0, "collective_wait": 5.0},
        {"busy": 15.0, "collective_wait": 0.0},
    ]
    seen = [metric_totals(r) for r in second]
    assert [(m["step_window_first_step"], m["step_window_steps"]) for m in seen] == [(10, 10)] * 3
    assert [m["step_window"] for m in seen] == [
        {"busy": 10.0, "collective_wait": 6.0},
        {"busy": 15.0, "collective_wait": 1.0},  # 5 x 0.2 s
        {"busy": 12.0, "collective_wait": 4.0},
    ]


def test_report_names_the_slowest_rank_in_text_and_json(job):
    root, _, _ = job
    run = [sys.executable, "-m", "ettr", "report", root, "--straggler-window", str(WINDOW)]
    out = subprocess.run([*run, "--json"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["stragglers"] == stragglers_root(root, window=WINDOW).to_dict()
    assert report["stragglers"]["windows"] == WINDOWS
    text = subprocess.run(run, capture_output=True, text=True, cwd=REPO)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    table = lines.index(next(l for l in lines if l.startswith("rank ")))
    assert [l.split() for l in lines[table + 1 : table + 4]] == [
        ["2", "20", "31.000", "27.000", "4.000", "1.400000", "0.250000"],
        ["1", "20", "31.000", "25.000", "6.000", "1.400000", "0.250000"],
        ["0", "20", "31.000", "20.000", "11.000", "1.400000", "0.250000"],
    ]
    assert lines[table + 4] == "slowest rank per 10-step window (busy s; the other ranks' median; waited s):"
    assert [l.split() for l in lines[table + 5 : table + 7]] == [
        ["steps", "0-9", "rank", "2", "15.000", "10.000", "5.000"],
        ["steps", "10-19", "rank", "1", "15.000", "11.000", "4.000"],
    ]
    assert lines[table + 7] == (
        "waiting for the slowest rank: 9.000 s of the job's time over 2 window(s); most for rank 2 (5.000 s)"
    )


def test_the_deviation_compares_the_last_100_steps_with_the_1000_before(tmp_path):
    """1,200 steps: steps 1-1100 alternate 0.8 and 1.2 s, of steps 1101-1200 every 5th takes 4 s and the rest 1 s.
    Sorted: 550 x 0.8, 80 x 1.0, 550 x 1.2, 20 x 4.0: median 1.0, MAD 0.2 (1,100 of the |t - 1| are 0.2), so the
    4 s steps are out and the ideal is (550 x 0.8 + 80 x 1.0 + 550 x 1.2) / 1180 = 1.0 s. The last 100 |t - 1|:
    80 x 0 and 20 x 3.0, p90 (at 89.1 of 0-99) 3.0; the 1,000 before: all 0.2. Deviation 3.0 - 0.2 = 2.8 s."""
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(str(tmp_path), rank=0, clock=clock, flush_interval=600.0).start()
    for s in range(1, 1201):
        tracker.step_begin(s)
        clock.advance((0.8 if s % 2 else 1.2) if s <= 1100 else (4.0 if s % 5 == 0 else 1.0))
        tracker.step_end(s)
    tracker.end()
    (rank,) = stragglers_root(str(tmp_path)).ranks
    assert (rank.steps, rank.ideal_step_us, rank.deviation_us) == (1200, 1_000_000, 2_800_000)


def test_the_deviation_with_fewer_steps():
    """Under 1,100 steps there is no baseline: from 100 on, the p90 of the last 100; under 100, the mean."""
    times = [1_000_000] * 139 + [3_000_000] * 11  # the last 100 |t - 1 s|: 89 x 0, 11 x 2 s: p90 2 s
    assert ideal_step(times) == 1_000_000 and step_deviation(times, 1_000_000) == 2_000_000
    assert step_deviation(times[-99:], 1_000_000) == 22_000_000 / 99  # 99 steps: the mean
    assert ideal_step([]) is None and step_deviation([], 1.0) is None
    assert ideal_step([4, 1, 1, 1]) == 1  # median 1, MAD 0: the 4 is left out


def test_ledgers_from_before_still_report(tmp_path):
    """Format-1 ledgers (no `v`, no collective_wait spans) of three ranks: busy time is the step time; the rank that
    ran no step is listed, and left out of the windows."""
    os.makedirs(tmp_path / "ettr")
    for rank, seconds in ((0, 1), (1, 3)):
        lines = [{"k": "start", "t": 0, "job": "j", "attempt": "old", "rank": rank}]
        lines += [{"k": "step", "s": s, "b": s * 10_000_000, "e": s * 10_000_000 + seconds * 1_000_000, "o": s}
                  for s in range(1, 4)]  # fmt: skip
        (tmp_path / "ettr" / f"ledger-old-rank{rank}.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    start = {"k": "start", "t": 0, "job": "j", "attempt": "old", "rank": 2}  # rank 2 died before its first step
    (tmp_path / "ettr" / "ledger-old-rank2.jsonl").write_text(json.dumps(start) + "\n")
    s = stragglers_root(str(tmp_path))
    assert [(r.rank, r.busy_us, r.wait_us, r.ideal_step_us, r.deviation_us) for r in s.ranks] == [
        (0, 3_000_000, 0, 1_000_000, 0),
        (1, 9_000_000, 0, 3_000_000, 0),
        (2, 0, 0, None, None),
    ]
    assert [(w.first_step, w.last_step, w.steps, w.slowest_rank, w.waited_us) for w in s.windows] == [
        (0, 99, 3, 1, 6_000_000)
    ]


def test_a_step_run_again_counts_its_kept_run_where_the_wall_clock_went_back(tmp_path, recwarn):
    """a1 runs steps 1-10 in 1 s and dies after committing 5; a2, on a node whose clock is 110 s behind, restores 5
    and runs 6-12 in 3 s. The report keeps a2's runs of 6-10 (placed after a1); the step times took a1's lost runs,
    sorting a2 first by its wall clock: 16 s of steps and an ideal step of 1 s, where the kept runs took 26 s."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=clock).start()
    tr.checkpoint_restored(None)
    for s in range(1, 11):
        with tr.step(s):
            clock.advance(1.0)
        if s == 5:
            tr.checkpoint_committed(5, 0.1)
    tr.flush()  # killed
    clock = FakeClock(900.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a2", rank=0, clock=clock).start()
    tr.checkpoint_restored(5)
    for s in range(6, 13):
        with tr.step(s):
            clock.advance(3.0)
    tr.end()
    (r,) = stragglers_root(str(tmp_path)).ranks
    assert (r.steps, r.step_us, r.ideal_step_us) == (12, 26_000_000, 26_000_000 / 12)


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window must be a positive number of steps, got 0"):
        stragglers([], window=0)
    with pytest.raises(ValueError, match="straggler_window must be a positive number of steps, got 0"):
        GoodputTracker("unused", straggler_window=0)


SLEEP, STEPS = 0.05, 30  # rank 1 sleeps 50 ms in each of 30 steps: at least 0.5 s of its own in each 10-step window


def test_under_torchrun_the_rank_slowed_by_a_sleep_is_named_in_the_report_and_the_metrics(tmp_path):
    """Two ranks under torchrun, gloo on this host: rank 1 sleeps in every step before the all_reduce, rank 0 waits
    for it there (a `collective_wait` span). Every step of both ranks lasts as long; rank 1's busy time holds the
    sleep, so rank 1 is the slowest in every window, in `ettr report` and in the ranks' own gauges."""
    root = tmp_path / "run"
    worker = os.path.join(REPO, "tests", "procs", "straggler_worker.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    launch += [f"--log-dir={os.devnull}"]  # else an empty torchelastic_* folder in /tmp per run
    proc = subprocess.run(
        [*launch, worker, str(root), "1", str(SLEEP), str(STEPS), str(WINDOW)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run = [sys.executable, "-m", "ettr", "report", str(root), "--straggler-window", str(WINDOW)]
    out = subprocess.run([*run, "--json"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)["stragglers"]
    assert [(w["first_step"], w["steps"], w["slowest_rank"]) for w in s["windows"]] == [
        (0, 10, 1),
        (10, 10, 1),
        (20, 10, 1),
    ]
    assert all(w["slowest_busy_seconds"] >= 10 * SLEEP and w["waited_seconds"] > 0 for w in s["windows"]), s
    assert s["slowest_rank"] == 1 and s["waited_seconds"] == pytest.approx(
        sum(w["waited_seconds"] for w in s["windows"])
    )
    ranks = {r["rank"]: r for r in s["ranks"]}
    assert ranks[1]["busy_seconds"] >= STEPS * SLEEP > ranks[0]["busy_seconds"]
    assert ranks[0]["steps"] == ranks[1]["steps"] == STEPS
    text = subprocess.run(run, capture_output=True, text=True, cwd=REPO)
    assert text.returncode == 0, text.stderr
    assert f"over 3 window(s); most for rank 1 ({s['waited_seconds']:.3f} s)" in text.stdout, text.stdout

    # each rank's gauge of its last window (steps 20-29, set at end()) carries its rank: the highest busy is rank 1
    seen = [json.loads((root / f"otel-rank{r}.json").read_text()) for r in (0, 1)]
    assert [(m["step_window_first_step"], m["step_window_steps"]) for m in seen] == [(20, 10), (20, 10)]
    busy = {p["ettr.rank"]: p["value"] for m in seen for p in m["step_window_points"] if p["ettr.part"] == "busy"}
    assert max(busy, key=busy.__getitem__) == 1 and busy[1] >= 10 * SLEEP, busy
    assert {p["ettr.job"] for m in seen for p in m["step_window_points"]} == {"straggler"}
