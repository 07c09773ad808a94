"""A saver that exits without close(): the saves in flight commit, retention still runs, and nothing is reported as
failed (at exit Python's thread pools take no new work; retention's deletes used to be refused there)."""

import subprocess
import sys

import ckpt
from ckpt import catalog
from ckpt.storage import open_storage

CHILD = """
import sys, torch, ckpt
m = ckpt.CheckpointManager(sys.argv[1], keep_last=2)
for step in range(1, 7):
    m.save(step, {"w": torch.full((256, 1024), float(step))})
# no wait(), no close(): the interpreter exits with the writer still at work
"""


def test_retention_runs_at_exit_without_close_and_reports_nothing(tmp_path):
    root = str(tmp_path / "ck")
    run = subprocess.run([sys.executable, "-c", CHILD, root], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "failed" not in run.stderr and "retention" not in run.stderr, run.stderr
    storage = open_storage(root)
    with ckpt.CheckpointManager(root) as m:
        steps = m.steps()
    assert steps == [5, 6], "every save committed and retention kept the last two"
    for s in steps:
        assert not list(catalog.verify(storage, s))
