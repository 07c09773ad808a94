"""The overlapped snapshot: what a save returns before copying (an optimizer's parameters and state) is copied as
it was at `save`, whatever the loop does next: the next optimizer step waits for the copy, anything else that
changes those tensors fails the save instead of committing a mixed state, and everything else is copied at once.

The snapshot thread is held back by a gate submitted ahead of the save (the real thread, only delayed), so that
the loop provably acts while the copy is still to be made.
"""

import contextlib
import threading

import pytest
import torch

import ckpt
import ettr


class Gate:
    """Holds the manager's snapshot thread until `open()`: the save's deferred copies queue behind it."""

    def __init__(self, manager):
        self.event = threading.Event()
        manager._snapshotter.submit(self.event.wait, 10)  # a failing test is not held long

    def open(self):
        self.event.set()


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optim


def train_step(model, optim, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 16, generator=g)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def saved_copy(model, optim):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": _optim_tensors(optim)}


def _optim_tensors(optim):
    return {(i, k): v.clone() for i, s in enumerate(optim.state.values()) for k, v in s.items()}


def restored(root, step):
    model, optim = make()
    train_step(model, optim, seed=99)  # Adam state exists, with other values
    with ckpt.CheckpointManager(root) as m:
        assert m.restore({"model": model, "optim": optim}, step=step) == step
    return {"model": model.state_dict(), "optim": _optim_tensors(optim)}


@contextlib.contextmanager
def held_save(root):
    """A trained model and Adam, a manager on `root` with its snapshot thread held, and save(1) of them under way:
    yields (model, optim, gate, handle, a copy of the state at the save); the manager closes after the block."""
    model, optim = make()
    train_step(model, optim)
    with ckpt.CheckpointManager(root) as m:
        gate = Gate(m)
        before = saved_copy(model, optim)
        yield model, optim, gate, m.save(1, {"model": model, "optim": optim}), before


def assert_same(a, b):
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


def test_an_optimizer_step_right_after_save_waits_and_the_checkpoint_holds_the_state_at_save(tmp_path):
    with held_save(tmp_path) as (model, optim, gate, handle, before):
        stepper = threading.Thread(target=train_step, args=(model, optim, 2))
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive(), "the optimizer step did not wait for the snapshot"
        now = saved_copy(model, optim)  # forward and backward ran: parameters and Adam's state are as saved
        assert all(torch.equal(p, before["model"][k]) for k, p in model.named_parameters())
        assert all(torch.equal(t, before["optim"][k]) for k, t in now["optim"].items())
        gate.open()
        stepper.join(10)
        handle.wait()
    assert not torch.equal(model[0].weight, before["model"]["0.weight"])  # the step went on after the copy
    assert_same(restored(tmp_path, 1), before)


def test_a_change_outside_an_optimizer_step_fails_the_save_naming_the_key_and_nothing_mixed_is_committed(tmp_path):
    model, optim = make()
    train_step(model, optim)
    state = {"model": model, "optim": optim}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
        first = saved_copy(model, optim)
        gate = Gate(m)
        handle = m.save(2, state)
        with torch.no_grad():
            model[2].bias.add_(1.0)  # not through optimizer.step(): nothing waits for the copy
        gate.open()
        with pytest.raises(ckpt.CheckpointWriteError, match=r"'model/2\.bias' \(version \d+ -> \d+\)") as e:
            handle.wait()
        assert isinstance(e.value.__cause__, ckpt.StateChangedError)
        assert m.steps() == [1]
        m.save(3, state).wait()  # the manager goes on
        assert m.steps() == [1, 3]
    assert_same(restored(tmp_path, 1), first)


def test_a_save_failing_before_its_write_is_reported_only_once_its_deferred_copies_are_made(tmp_path):
    """The next save reuses the arena: copies of a failed save still running would overwrite what it staged."""
    (tmp_path / "run.json").mkdir()  # the first save cannot record its run: it fails before writing any array
    (tmp_path / "run.json" / "x").write_text("")
    with held_save(tmp_path) as (model, optim, gate, handle, before):
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0.5)  # not reported while its copies are held back
        gate.open()
        with pytest.raises(ckpt.CheckpointWriteError):
            handle.wait()
        assert handle._pending.done()


def test_wait_snapshot_makes_any_change_safe(tmp_path):
    with held_save(tmp_path) as (model, optim, gate, handle, before):
        threading.Timer(0.3, gate.open).start()
        handle.wait_snapshot()
        with torch.no_grad():
            model[2].bias.add_(1.0)
        handle.wait()
    assert_same(restored(tmp_path, 1), before)


def test_buffers_that_forward_changes_are_copied_inside_save(tmp_path):
    """BatchNorm's running statistics change in forward, before any optimizer step: they are never deferred."""
    with held_save(tmp_path) as (model, optim, gate, handle, before):
        model(torch.randn(8, 16)).sum().backward()  # running_mean/var change; parameters do not
        assert not torch.equal(model[1].running_mean, before["model"]["1.running_mean"])
        gate.open()
        handle.wait()
    assert_same(restored(tmp_path, 1), before)


def test_tensors_outside_an_optimizer_and_sync_mode_are_copied_inside_save(tmp_path):
    model, optim = make()
    train_step(model, optim)
    extra = torch.arange(10.0)
    for mode, root in (("overlap", tmp_path / "a"), ("sync", tmp_path / "b")):
        with ckpt.CheckpointManager(root, snapshot=mode) as m:
            gate = Gate(m)
            handle = m.save(1, {"model": model, "optim": optim, "extra": extra})
            deferred = set(handle._pending._versions) if handle._pending else set()
            extra.add_(1)  # never deferred: changing it after save is safe in either mode
            if mode == "sync":
                handle.wait_snapshot()  # nothing left to copy: returns at once, the snapshot thread still held
            gate.open()
            handle.wait()
            out = {"extra": torch.zeros(10)}
            m.restore(out, keys=["extra"], track=False)
            assert torch.equal(out["extra"], extra - 1)
        if mode == "overlap":  # parameters and Adam's state wait; buffers and other tensors do not
            assert {"model/0.weight", "model/1.weight"} <= deferred and any(k.startswith("optim/") for k in deferred)
            assert not deferred & {"model/1.running_mean", "model/1.running_var", "extra"}
        else:
            assert deferred == set()


def test_a_capped_arena_copies_everything_inside_save(tmp_path):
    """Past the staging cap the snapshot is taken in waves inside save: nothing is left for the optimizer to wait for."""
    model, optim = make()
    train_step(model, optim)
    with ckpt.CheckpointManager(tmp_path, max_staging_bytes=4096, pack_bytes=0) as m:
        handle = m.save(1, {"model": model, "optim": optim})
        assert handle._pending is None
        handle.wait()


def test_the_wait_of_an_optimizer_step_is_checkpoint_time_and_close_removes_the_fence(tmp_path):
    from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks

    n_hooks = len(hooks)
    model, optim = make()
    train_step(model, optim)
    tracker = ettr.GoodputTracker(str(tmp_path)).start()
    with ckpt.CheckpointManager(tmp_path, tracker=tracker) as m:
        gate = Gate(m)
        m.save(1, {"model": model, "optim": optim})
        assert len(hooks) == n_hooks + 1
        threading.Timer(0.3, gate.open).start()
        with tracker.step(2):
            train_step(model, optim, 2)
    assert len(hooks) == n_hooks
    tracker.end()
    spans = [r for ledger in ettr.read_ledgers(str(tmp_path)) for r in ledger.records if r.get("k") == "span"]
    waits = [s for s in spans if s["c"] == "checkpoint_save" and s.get("a", {}).get("step") == 1]
    assert len(waits) == 2  # the save call, and the optimizer step's wait for its copy
    assert max(s["e"] - s["b"] for s in waits) >= 0.25e6


def test_snapshot_mode_is_checked():
    with pytest.raises(ValueError, match="snapshot must be one of"):
        ckpt.CheckpointManager("memory://x", snapshot="lazy")
