"""What the manager tells a goodput tracker lands in the ledger: saves, commits, restores, failures."""

import contextlib
import time

import pytest
import torch

import ckpt
import ettr
from test_ckpt_snapshot import seen_calling


def _records(root):
    return [r for ledger in ettr.read_ledgers(str(root)) for r in ledger.records]


def test_manager_reports_saves_commits_and_restores(tmp_path):
    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    state = {"w": torch.randn(100, 100)}
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        assert m.restore(state) is None
        tracker.step_begin(1)
        tracker.step_end(1)
        m.save(1, state).wait()
        m.restore(state, keys=["w"], track=False)  # an evaluation load is not a resume point
    tracker.end()
    recs = _records(tmp_path)
    assert [r["s"] for r in recs if r.get("k") == "restore"] == [None]
    commits = [r for r in recs if r.get("k") == "commit"]
    assert [c["s"] for c in commits] == [1] and commits[0]["bg"] > 0
    attribution = ettr.attribute_root(str(tmp_path))
    assert attribution.micros["checkpoint_save"] > 0 and attribution.micros["checkpoint_restore"] > 0
    assert attribution.committed_steps == (1,)


def test_manager_reports_a_failed_background_write(tmp_path):
    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    (tmp_path / "step_00000002").write_text("a file where the step directory should go")
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        with pytest.raises(ckpt.CheckpointWriteError):
            m.save(2, {"w": torch.zeros(3)}).wait()
    tracker.end()
    failed = [r for r in _records(tmp_path) if r.get("k") == "ckpt_failed"]
    assert [r["s"] for r in failed] == [2] and "step 2" in failed[0]["err"]


class _FailingObserver:
    """A tracker whose own ledger cannot be written when a save fails (the same full disk, say)."""

    def span(self, category, **attrs):
        return contextlib.nullcontext()

    def checkpoint_committed(self, step, background_seconds, nbytes, *, tier=None):
        pass

    def checkpoint_restored(self, step, *, tier=None):
        pass

    def checkpoint_failed(self, step, error):
        raise OSError(28, "No space left on device: the tracker's ledger")


def test_a_tracker_that_raises_on_a_failed_save_still_lets_the_save_and_the_next_ones_report(tmp_path):
    """Before, the failed save's handle never resolved: wait(), the next save and close() hung forever."""
    (tmp_path / "step_00000002").write_text("a file where the step directory should go")
    m = ckpt.CheckpointManager(tmp_path, tracker=_FailingObserver())
    handle = m.save(2, {"w": torch.zeros(3)})
    with pytest.raises(ckpt.CheckpointWriteError, match="step 2"):
        handle.wait(timeout=60)  # a guard (the old code never resolved it): no close to hang in, should it fail
    m.save(3, {"w": torch.ones(3)}).wait()
    assert m.steps() == [3]
    m.close()


class _ObserverThatCannotRecordCommits(_FailingObserver):
    def checkpoint_committed(self, step, background_seconds, nbytes, *, tier=None):
        raise OSError(28, "No space left on device: the tracker's ledger")


def test_a_tracker_that_raises_on_a_commit_leaves_the_save_committed_and_reported_so(tmp_path):
    """Before, the committed step's handle raised CheckpointWriteError ("saving step 1 failed"): a retry of it then
    met StepExistsError, and the retention after it did not run."""
    with ckpt.CheckpointManager(tmp_path, tracker=_ObserverThatCannotRecordCommits()) as m:
        m.save(1, {"w": torch.ones(3)}).wait()
        assert m.steps() == [1]


def test_a_tracker_set_to_none_reports_to_nobody(tmp_path):
    """Lightning hands the manager `tracker=None` between fits: saves and restores then go on, reported to nobody."""
    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        m.tracker = None
        assert m.tracker is not None
        m.save(1, {"w": torch.ones(3)}).wait()
        assert m.restore({"w": torch.zeros(3)}) == 1
        m.tracker = tracker
        m.save(2, {"w": torch.ones(3)}).wait()
    tracker.end()
    assert [r["s"] for r in _records(tmp_path) if r.get("k") == "commit"] == [2]


def test_two_tier_commits_name_their_tier_so_a_lost_local_tier_reads_as_a_node_loss(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    state = {"w": torch.arange(10.0)}
    tracker = ettr.GoodputTracker(str(durable)).start()
    with ckpt.CheckpointManager(durable, local=local, persist_every=2, tracker=tracker) as m:
        m.restore(state)
        for s in range(1, 5):
            tracker.step_begin(s)
            tracker.step_end(s)
            m.save(s, state).wait()
        m.wait()  # the persist of step 4
    tracker.end("error")  # the node dies after step 4: its local tier with it
    commits = [(r["s"], r.get("tier")) for r in _records(durable) if r.get("k") == "commit"]
    assert sorted(commits) == [(1, "local"), (2, "durable"), (2, "local"), (3, "local"), (4, "durable"), (4, "local")]
    import shutil

    shutil.rmtree(local)
    tracker = ettr.GoodputTracker(str(durable)).start()
    with ckpt.CheckpointManager(durable, local=local, persist_every=2, tracker=tracker) as m:
        assert m.restore(state) == 4
    tracker.end()
    attribution = ettr.attribute_root(str(durable))
    # the durable step 4 equals the newest local commit: only the commit tiers tell that the local copy was lost
    assert attribution.failure_classes["node"] == 1
    assert attribution.restores_per_tier["durable"][0] == 1


def test_a_one_tier_restore_names_no_tier(tmp_path):
    state = {"w": torch.arange(4.0)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        assert m.restore(state) == 1
    tracker.end()
    assert [(r["s"], r.get("tier")) for r in _records(tmp_path) if r.get("k") == "restore"] == [(1, None)]
    # so a one-tier job's report has no per-tier lines and no two-tier advice
    assert list(ettr.attribute_root(str(tmp_path)).restores_per_tier) == [None]


def test_a_save_that_waits_for_the_previous_one_reports_the_wait_as_a_part_of_it(tmp_path):
    """The manager times its wait for the save in flight as the checkpoint_save part "previous_wait", inside the
    save's own span: attribution splits the save's seconds, the save histogram still sees one save per call."""
    import threading

    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    gate = threading.Event()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        commit = m._commit
        m._commit = lambda *args: (gate.wait(), commit(*args))[1]  # the first write cannot finish before the gate
        m.save(1, {"w": torch.ones(3)})
        main = threading.get_ident()  # the gate opens 0.3 s after save(2) is seen draining save 1 (its wait began)
        threading.Thread(target=lambda: (seen_calling(main, "save", "drain"), time.sleep(0.3), gate.set())).start()
        m.save(2, {"w": torch.ones(3)}).wait()
    tracker.end()
    spans = [r for r in _records(tmp_path) if r.get("k") == "span" and r["c"] == "checkpoint_save"]
    assert [s.get("a") for s in spans] == [{"step": 1}, {"step": 2, "part": "previous_wait"}, {"step": 2}]
    wait, save2 = spans[1], spans[2]
    assert save2["b"] <= wait["b"] and wait["e"] <= save2["e"] and wait["e"] - wait["b"] >= 0.2e6
    a = ettr.attribute_root(str(tmp_path))
    assert a.saves == 2 and a.checkpoint_split_us["previous_wait"] == wait["e"] - wait["b"]
    assert sum(a.checkpoint_split_us.values()) == a.micros["checkpoint_save"]
