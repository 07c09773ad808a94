"""Lightning: Trainer.fit through CkptCheckpointIO + GoodputCallback is SIGKILLed, resumed from "last", and ends
bitwise equal to an uninterrupted fit; the goodput report shows the failure, the lost steps and the restore."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from kill_resume import (  # noqa: E402
    assert_reported, assert_same_bits, finish, losses, start, straight_killed_resumed)
from ckpt.data import explain  # noqa: E402
from ckpt import layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from integrations.lightning import CkptCheckpointIO, saveable  # noqa: E402

CHILD = Path(__file__).parent / "procs" / "lightning_train.py"
STEPS, KILL_AT = 16, 10  # the child saves every 4 steps: the resume is from step 8


def test_sigkill_resume_is_bitwise_and_reported(tmp_path):
    runs = straight_killed_resumed(CHILD, tmp_path, STEPS, KILL_AT)

    # the resumed attempt re-ran steps 9.. from the step-8 checkpoint with the same losses, to the same bits
    reference = losses(runs.straight)
    assert losses(runs.killed) == {s: reference[s] for s in range(1, KILL_AT + 1)}
    assert losses(runs.resumed) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(runs.straight_npz, runs.resumed_npz)

    # pointers removed by ModelCheckpoint took their steps along; only the newest survives
    assert sorted(p.name for p in (tmp_path / "job" / "pointers").iterdir()) == ["epoch=0-step=16.ckpt", "last.ckpt"]
    assert [p.name for p in (tmp_path / "job").glob("step_*")] == ["step_00000016"]

    assert_reported(tmp_path / "job", restored=8, lost_steps=KILL_AT - 8)


def pointers(root: Path) -> dict[str, int]:
    """Pointer file name -> the step it names, in ROOT/pointers."""
    return {p.name: json.loads(p.read_text())["step"] for p in sorted((root / "pointers").iterdir())}


def test_copied_run_resumes_twice_bitwise_without_duplicate_or_stale_pointers(tmp_path):
    """Killed at 6 (checkpoint 4), resumed and killed at 10 (checkpoint 8), copied, resumed from the copy to 16."""
    job, copy = tmp_path / "job", tmp_path / "copy"
    straight = start(CHILD, tmp_path / "straight", tmp_path / "straight.npz", STEPS)
    first = start(CHILD, job, tmp_path / "x.npz", STEPS, 6)
    reference, _ = losses(finish(straight)), finish(first)
    assert pointers(job) == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4} and layout.committed_steps(open_storage(job))[-1] == 4
    finish(start(CHILD, job, tmp_path / "x.npz", STEPS, 10))  # resumes from 4: its dict predates last.ckpt
    assert pointers(job) == {"epoch=0-step=8.ckpt": 8, "last.ckpt": 8} and layout.committed_steps(open_storage(job))[-1] == 8

    shutil.copytree(job, copy)
    before = sorted((p.relative_to(job), p.stat().st_mtime_ns) for p in job.rglob("*"))
    lines = finish(start(CHILD, copy, tmp_path / "resumed.npz", STEPS))
    assert ["done"] in lines, lines[-5:]
    assert losses(lines) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(tmp_path / "straight.npz", tmp_path / "resumed.npz")
    assert sorted((p.relative_to(job), p.stat().st_mtime_ns) for p in job.rglob("*")) == before  # original untouched
    assert pointers(copy) == {f"epoch=0-step={STEPS}.ckpt": STEPS, "last.ckpt": STEPS}  # no -v1, last is newest
    assert layout.committed_steps(open_storage(copy)) == [STEPS]

    # one step numbering: the checkpoint named step=16 explains each step's batch as the fit logged it
    io = CkptCheckpointIO(copy)
    saved = io.load_checkpoint(copy / "pointers" / "last.ckpt")
    io.teardown()
    (sampler,) = [state["samplers"]["train"] for state in saved["callbacks"].values() if "samplers" in state]
    batches = {int(w[1]): [int(i) for i in w[2].split(",")] for w in lines if w[0] == "batch"}
    assert sampler["step"] == STEPS and all(explain(sampler, s).indices == batches[s] for s in range(9, STEPS + 1))


def test_saveable_drops_what_needs_pickle():
    class Opaque:
        pass

    clean, dropped = saveable({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {
        "lr": 0.1, "path": Path("/x"), "act": Opaque(), "sizes": (1, 2), "objs": [1, Opaque()], 3: "int key",
        (1, 2): "tuple key"}})
    assert dropped == ["hyper_parameters.act", "hyper_parameters.objs", "hyper_parameters.(1, 2)"]
    assert clean["hyper_parameters"] == {"lr": 0.1, "path": "/x", "sizes": (1, 2), 3: "int key"}


def test_pointer_of_a_step_that_never_committed_falls_back(tmp_path):
    io = CkptCheckpointIO(tmp_path / "root")
    io.save_checkpoint({"global_step": 4, "w": torch.arange(3.0)}, tmp_path / "p" / "a.ckpt")
    io.teardown()
    (tmp_path / "p" / "b.ckpt").write_text(
        (tmp_path / "p" / "a.ckpt").read_text().replace('"step": 4', '"step": 8'))  # as if killed mid-write
    with pytest.warns(RuntimeWarning, match="step 8 was never committed"):
        loaded = io.load_checkpoint(tmp_path / "p" / "b.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["w"], torch.arange(3.0))
    (tmp_path / "p" / "c.ckpt").write_bytes(b"\x80\x02not json")
    with pytest.raises(ValueError, match="not a checkpoint written by CkptCheckpointIO"):
        io.load_checkpoint(tmp_path / "p" / "c.ckpt")
    io.teardown()


def test_pointers_are_relative_and_the_next_writer_drops_those_of_steps_that_never_committed(tmp_path):
    root, folder = tmp_path / "root", tmp_path / "root" / "p"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.arange(3.0)}, folder / "a.ckpt")
    io.teardown()
    assert json.loads((folder / "a.ckpt").read_text())["root"] == ".."
    for name in ("b.ckpt", "last.ckpt"):  # as if killed while step 8 was written
        (folder / name).write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 8}))
    (folder / "old.ckpt").write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": str(root), "step": 4}))

    io = CkptCheckpointIO(root)  # the restarted writer
    assert io.load_checkpoint(folder / "old.ckpt")["global_step"] == 4  # absolute roots of older pointers still load
    with pytest.warns(RuntimeWarning, match="step 8 was never committed"):
        assert io.load_checkpoint(folder / "last.ckpt")["global_step"] == 4
    with pytest.warns(RuntimeWarning, match="not committed") as removed:
        io.save_checkpoint({"global_step": 5, "w": torch.zeros(3)}, folder / "c.ckpt")
    io.teardown()
    assert sorted(str(w.message).split(":")[0] for w in removed) == [f"removing {folder / n}"
                                                                      for n in ("b.ckpt", "last.ckpt")]
    assert sorted(p.name for p in folder.iterdir()) == ["a.ckpt", "c.ckpt", "old.ckpt"]


def _fit(root: Path, steps: int, ckpt_path: str | None = None, **io_options) -> dict[str, torch.Tensor]:
    """A tiny fit through CkptCheckpointIO + GoodputCallback (the child's model and data); returns its final weights."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckpt.data import ShuffledSampler, make_loader
    from integrations.lightning import GoodputCallback
    from lightning_train import Net, Points

    torch.manual_seed(0)
    sampler = ShuffledSampler(64, 8, seed=1)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
                      plugins=[CkptCheckpointIO(root, **io_options)],
                      callbacks=[GoodputCallback(samplers={"train": sampler}),
                                 ModelCheckpoint(dirpath=root / "pointers", every_n_train_steps=4, save_last=True)])
    model = Net()
    trainer.fit(model, train_dataloaders=make_loader(Points(), sampler), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return {k: v.clone() for k, v in model.state_dict().items()}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def no_launcher_ids(monkeypatch):
    from ckpt.run import ENV_IDS

    for var in ENV_IDS:
        monkeypatch.delenv(var, raising=False)


def test_fit_without_ckpt_path_into_another_runs_root_fails_before_touching_it(tmp_path, no_launcher_ids):
    import ckpt

    root = tmp_path / "run"
    _fit(root, 8)
    before = _tree(root)
    with pytest.raises(ckpt.RunMismatchError, match=r'committed steps \[8\].*ckpt_path="last".*new root'):
        _fit(root, 12)
    assert _tree(root) == before, "nothing written (no ledger of the refused attempt either) or deleted"
    _fit(root, 12, ckpt_path="last")  # the explicit resume takes the run over


def test_a_restart_of_the_same_run_resumes_without_ckpt_path(tmp_path, no_launcher_ids):
    from ettr import attribute_root

    straight = _fit(tmp_path / "straight", 12)
    _fit(tmp_path / "job", 8, run_id="job-1")  # as if torchrun or a requeue restarted it with the same id
    resumed = _fit(tmp_path / "job", 12, run_id="job-1")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [a.restored_step for a in attribute_root(str(tmp_path / "job")).attempts] == [None, 8]


def test_saveable_keeps_exactly_what_a_save_stores():
    """The same `encodable` check as the library: a long double (no exact form) is dropped instead of failing the
    save, and a torch.Size stays a Size."""
    import numpy as np

    clean, dropped = saveable({"hp": {"eps": np.longdouble(1e-8), "shape": torch.Size([2, 3]), "n": np.int64(4)}})
    assert dropped == ["hp.eps"] and type(clean["hp"]["shape"]) is torch.Size and clean["hp"]["n"] == 4
