"""End to end: a small training run with the checkpoint manager is SIGKILLed twice, resumed, and accounted for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ettr import attribute_root

CHILD = r"""
import json, os, sys, time
root, stop_after, hang = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hang"
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from ettr import GoodputMetrics, GoodputTracker, metric_totals
reader = InMemoryMetricReader()
tracker = GoodputTracker(root, flush_interval=0,
                         metrics=GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("e2e"))).start()
print(f"started {time.time()}", flush=True)
import torch
from ckpt import CheckpointManager
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
state = {"model": model, "optim": opt}
with CheckpointManager(root, tracker=tracker) as m:
    start = m.restore(state) or 0
    print(f"restored {start}", flush=True)
    for step in range(start + 1, stop_after + 1):
        outer = time.perf_counter()
        with tracker.step(step):
            with tracker.span("data_wait"):
                w = time.perf_counter()
                x = torch.randn(64, 32)
                time.sleep(0.002)
                wait = time.perf_counter() - w
            t = time.perf_counter()
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.02)
            compute = time.perf_counter() - t
        outer = time.perf_counter() - outer
        # compute <= the tracker's productive time for the step <= the whole step less its data wait
        print(f"step {step} {compute:.6f} {outer - wait:.6f}", flush=True)
        if step % 10 == 0:
            m.save(step, state)
    if hang:  # last checkpoint durable, then die in the middle of the next step
        m.wait()
        print("hanging", flush=True)
        with tracker.step(stop_after + 1):
            time.sleep(600)
print(f"ending {time.time()}", flush=True)
tracker.end()
with open(os.path.join(root, "otel.json"), "w") as f:
    json.dump(metric_totals(reader), f)
print(f"done {time.time()}", flush=True)
"""


def run_child(script, root, stop_after, hang):
    """Run one attempt; SIGKILL it when it says it is hanging. Returns its stdout lines."""
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(stop_after), "hang" if hang else "run"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.split())
        if line.startswith("hanging"):
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=120) == (-signal.SIGKILL if hang else 0)
    return lines


def test_killed_twice_and_resumed(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    t0 = time.time()
    runs = [run_child(script, root, 25, True), run_child(script, root, 37, True), run_child(script, root, 50, False)]
    # the job's wall time lies between the child's own clock reads and the test's
    at = {(k, l[0]): float(l[1]) for k, r in enumerate(runs) for l in r if l[0] in ("started", "ending", "done")}
    shortest, longest = at[(2, "ending")] - at[(0, "started")], at[(2, "done")] - t0

    a = attribute_root(str(root))
    restored = [int(l[1]) for r in runs for l in r if l[0] == "restored"]
    assert restored == [0, 20, 30]
    assert [at.restored_step for at in a.attempts] == [None, 20, 30]
    assert [at.status for at in a.attempts] == ["failed", "failed", "ok"]
    assert sum(a.micros.values()) == a.wall_us
    # (+20 ms: the first attempt is dated from its process's start, which /proc gives in clock ticks of 10 ms)
    assert shortest <= a.wall_us / 1e6 <= longest + 0.02

    # lost = the productive time of the steps re-run: 21-25 of attempt 1 and 31-37 of attempt 2. The child
    # brackets it from inside (its compute) and from outside (the whole step less its data wait): bounds
    # that hold however long the scheduler holds it between the tracker's clock reads and its own
    assert [at.lost_steps for at in a.attempts] == [5, 7, 0]
    timed = {(k, int(l[1])): (float(l[2]), float(l[3])) for k, r in enumerate(runs) for l in r if l[0] == "step"}
    rerun = [timed[(0, s)] for s in range(21, 26)] + [timed[(1, s)] for s in range(31, 38)]
    lower, upper = sum(t[0] for t in rerun), sum(t[1] for t in rerun)
    assert lower <= a.micros["lost"] / 1e6 <= upper + 1e-5
    assert a.micros["downtime"] > 0 and a.micros["startup"] > 0 and a.micros["checkpoint_save"] > 0
    assert a.background_us > 0 and a.committed_steps == (10, 20, 30, 40, 50)

    # the last process's OpenTelemetry in-memory reader saw the whole job's totals
    seen = json.loads((root / "otel.json").read_text())
    assert seen["seconds"] == pytest.approx({k: v / 1e6 for k, v in a.micros.items() if v}, abs=1e-5)
    assert seen["failures"] == 2
    assert seen["ettr"]["cumulative"] == pytest.approx(a.ettr, abs=1e-4)
    assert seen["ettr.checkpoint_save.duration"]["count"] == 2
