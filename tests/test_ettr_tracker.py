"""GoodputTracker with real processes: what reaches the ledger before a SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ettr import CATEGORIES, attribute_root
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
