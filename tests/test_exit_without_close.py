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


LOCAL_CHILD = """
import sys, torch, ckpt
m = ckpt.CheckpointManager(sys.argv[1], local=sys.argv[2], persist_every=2, keep_local=2)
for step in range(1, 5):
    m.save(step, {"w": torch.full((256, 1024), float(step))})
# no close(): step 4's persist is queued at the last save, as the interpreter begins to exit
"""


def test_a_local_tier_persists_its_last_step_at_exit_without_close(tmp_path):
    """With a local tier, the persist queued by the last save still reaches the durable root when the process
    exits without close() (its own pool refused the work at exit: the durable root stayed at step 2)."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    run = subprocess.run(
        [sys.executable, "-c", LOCAL_CHILD, durable, local], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "failed" not in run.stderr, run.stderr
    storage = open_storage(durable)
    with ckpt.CheckpointManager(durable) as m:
        assert m.steps() == [2, 4], "every K-th step persisted, the last one too"
    assert not list(catalog.verify(storage, 4))


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
