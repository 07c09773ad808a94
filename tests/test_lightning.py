"""Lightning: Trainer.fit through CkptCheckpointIO + GoodputCallback is SIGKILLed, resumed from "last", and ends
bitwise equal to an uninterrupted fit; the goodput report shows the failure, the lost steps and the restore."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from kill_resume import assert_reported, assert_same_bits, losses, straight_killed_resumed  # noqa: E402
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
