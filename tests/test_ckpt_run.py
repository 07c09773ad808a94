"""A root's run identity (ROOT/run.json), background deletes that no save waits for, one span per save."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import ckpt
from ckpt import catalog, layout
from ckpt import run as ckpt_run

HOW = {"how_to_resume": "resume it", "how_to_start_over": "start over"}


@pytest.fixture(autouse=True)
def no_launcher_ids(monkeypatch):
    for var in ckpt_run.ENV_IDS:
        monkeypatch.delenv(var, raising=False)


def _save(root, steps, **options) -> ckpt.CheckpointManager:
    m = ckpt.CheckpointManager(root, **options)
    for s in steps:
        m.save(s, {"w": torch.full((64,), float(s))})
    m.wait()
    return m


def test_first_save_records_the_run_and_a_fresh_start_of_another_run_is_refused(tmp_path):
    m = _save(tmp_path, [1, 2], run_id="job-7")
    m.close()
    record = json.loads((tmp_path / ckpt_run.RUN_FILE).read_text())
    assert record["id"] == "job-7" and record["source"] == "run_id" and record["host"]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    other = ckpt.CheckpointManager(tmp_path)  # no launcher id: a generated one, another run
    with pytest.raises(ckpt.RunMismatchError, match=r"committed steps \[1, 2\] of run 'job-7'.*resume it.*start over"):
        ckpt_run.check_start(other.storage, other.run, resume=False, **HOW)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing written or deleted"

    # the same run restarting (same id, e.g. a requeue) resumes; an explicit resume takes the root over
    same = ckpt.CheckpointManager(tmp_path, run_id="job-7")
    assert ckpt_run.check_start(same.storage, same.run, resume=False, **HOW) is True
    assert ckpt_run.check_start(other.storage, other.run, resume=True, **HOW) is True
    assert ckpt_run.recorded_run(other.storage).id == other.run.id
    # an empty root starts fresh
    empty = ckpt.CheckpointManager(tmp_path / "new")
    assert ckpt_run.check_start(empty.storage, empty.run, resume=False, **HOW) is False


def test_launcher_ids(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not an id
    assert ckpt_run.Run.current().source == "generated"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-1")
    assert ckpt_run.Run.current().id == "rdzv-1"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a requeue keeps it, a torchrun --standalone inside does not
    assert (ckpt_run.Run.current().id, ckpt_run.Run.current().source) == ("4242", "SLURM_JOB_ID")
    monkeypatch.setenv("CKPT_RUN_ID", "mine")
    assert ckpt_run.Run.current().id == "mine" and ckpt_run.Run.current("arg").id == "arg"


def test_malformed_run_record_is_named(tmp_path):
    _save(tmp_path, [1]).close()
    (tmp_path / ckpt_run.RUN_FILE).write_text("{not json")
    m = ckpt.CheckpointManager(tmp_path)
    with pytest.raises(ckpt.CorruptCheckpointError, match="run record is malformed.*run.json"):
        ckpt_run.check_start(m.storage, m.run, resume=False, **HOW)


def test_discard_removes_steps_and_record(tmp_path):
    _save(tmp_path, [1, 2]).close()
    storage = ckpt.CheckpointManager(tmp_path).storage
    assert ckpt_run.discard(storage) == [1, 2]
    assert layout.committed_steps(storage) == [] and ckpt_run.recorded_run(storage) is None


class _HeldDeletes:
    """Wraps the real catalog.delete_step so a test can hold deletions and see which thread runs them."""

    def __init__(self, monkeypatch):
        self.release, self.threads = threading.Event(), []
        real = catalog.delete_step

        def held(storage, step):
            self.threads.append(threading.current_thread().name)
            self.release.wait(10)  # a caller that waits for the deletion goes on after 10 s, and finds it done
            real(storage, step)

        monkeypatch.setattr(catalog, "delete_step", held)


def test_delete_returns_at_once_and_no_save_waits_for_it(tmp_path, monkeypatch):
    m = _save(tmp_path, [1, 2, 3])
    held = _HeldDeletes(monkeypatch)
    m.delete(1)  # returns while the deletion is held
    assert m.steps() == [2, 3] and (tmp_path / "step_00000001").exists()
    m.save(4, {"w": torch.zeros(64)}).wait()  # the next save neither waits for it nor is blocked by it
    assert m.steps() == [2, 3, 4]
    with pytest.raises(ValueError, match="not a committed step"):
        m.delete(1)
    with pytest.raises(ValueError, match="newest committed step"):
        m.delete(4)
    held.release.set()
    m.wait()
    assert not (tmp_path / "step_00000001").exists() and held.threads == ["ckpt-deleter_0"]
    m.close()


def test_retention_deletes_are_off_the_next_saves_path(tmp_path, monkeypatch):
    m = _save(tmp_path, [1], keep_last=1)
    held = _HeldDeletes(monkeypatch)
    m.save(2, {"w": torch.zeros(64)})
    m.save(3, {"w": torch.zeros(64)}).wait()  # retention of step 1 (after 2) is held; saving 3 does not wait
    assert layout.committed_steps(m.storage) == [1, 2, 3]
    held.release.set()
    m.close()
    assert layout.committed_steps(m.storage) == [3]


def test_a_failed_delete_is_raised_by_the_next_call(tmp_path, monkeypatch):
    m = _save(tmp_path, [1, 2])

    def broken(storage, step):
        raise PermissionError("read-only root")

    monkeypatch.setattr(catalog, "delete_step", broken)
    m.delete(1)
    with pytest.raises(ckpt.CheckpointDeleteError, match="deleting step 1 failed: PermissionError: read-only root"):
        m.wait()
    m.close()


def test_nested_span_of_the_same_category_is_one_span(tmp_path):
    from ettr import GoodputTracker, attribute_root

    with GoodputTracker(str(tmp_path)) as tracker:
        manager = ckpt.CheckpointManager(tmp_path, tracker=tracker)
        for step in (1, 2):
            tracker.step_begin(step)
            tracker.step_end(step)
            with tracker.span("checkpoint_save", step=step):  # an integration's save around the manager's own
                manager.save(step, {"w": torch.zeros(8)})
        manager.close()
    assert len(attribute_root(str(tmp_path)).save_us) == 2
