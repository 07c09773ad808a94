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


def test_a_manager_dropped_without_close_frees_the_root_at_once(tmp_path):
    """A notebook cell run again rebinds `m` to a new manager: the dropped one (no save in flight) releases the
    root's lease when its last reference goes, not when the garbage collector next finds its cycles (the new
    manager's save used to fail with LeaseHeldError naming this very process)."""
    import gc

    import torch

    gc.collect()
    gc.disable()
    try:
        m = ckpt.CheckpointManager(tmp_path)
        m.save(1, {"w": torch.ones(4)}).wait()
        m = ckpt.CheckpointManager(tmp_path)
        m.save(2, {"w": torch.ones(4)}).wait()
        assert m.steps() == [1, 2]
        m.close()
    finally:
        gc.enable()
