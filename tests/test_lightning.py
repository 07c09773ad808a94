"""Lightning: Trainer.fit through CkptCheckpointIO + GoodputCallback is SIGKILLed, resumed from "last", and ends
bitwise equal to an uninterrupted fit; the goodput report shows the failure, the lost steps and the restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")

from ettr import attribute_root, report_text  # noqa: E402
from integrations.lightning import CkptCheckpointIO, saveable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "procs" / "lightning_train.py"
STEPS, EVERY, KILL_AT = 16, 4, 10


def start(root: Path, out: Path, hang_at: int | None = None) -> subprocess.Popen:
    """Start one fit attempt as a child process."""
    args = [sys.executable, str(CHILD), str(root), str(out), str(STEPS)] + ([str(hang_at)] if hang_at else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def finish(proc: subprocess.Popen) -> list[list[str]]:
    """Read a child's lines; SIGKILL it when it says it is hanging. Returns the split lines."""
    lines = []
    for line in proc.stdout:
        lines.append(line.split())
        if line.startswith("hanging"):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=120)
    return lines


def losses(lines: list[list[str]]) -> dict[int, str]:
    """Step -> loss (float hex) printed by a child."""
    return {int(l[1]): l[2] for l in lines if l and l[0] == "loss"}


def test_sigkill_resume_is_bitwise_and_reported(tmp_path):
    straight = start(tmp_path / "straight", tmp_path / "straight.npz")
    killed = start(tmp_path / "job", tmp_path / "unused.npz", hang_at=KILL_AT)
    straight_lines, killed_lines = finish(straight), finish(killed)
    assert straight.returncode == 0 and ["done"] in straight_lines
    assert killed.returncode == -signal.SIGKILL and ["hanging"] in killed_lines
    resumed = start(tmp_path / "job", tmp_path / "resumed.npz")
    resumed_lines = finish(resumed)
    assert resumed.returncode == 0 and ["done"] in resumed_lines

    # the resumed attempt re-ran steps 9.. from the step-8 checkpoint with the same losses, to the same bits
    reference = losses(straight_lines)
    assert losses(killed_lines) == {s: reference[s] for s in range(1, KILL_AT + 1)}
    assert losses(resumed_lines) == {s: reference[s] for s in range(9, STEPS + 1)}
    a, b = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        assert a[key].tobytes() == b[key].tobytes(), key

    # pointers removed by ModelCheckpoint took their steps along; only the newest survives
    assert sorted(p.name for p in (tmp_path / "job" / "pointers").iterdir()) == ["epoch=0-step=16.ckpt", "last.ckpt"]
    assert [p.name for p in (tmp_path / "job").glob("step_*")] == ["step_00000016"]

    report = attribute_root(str(tmp_path / "job"))
    assert [at.status for at in report.attempts] == ["failed", "ok"]
    assert [at.restored_step for at in report.attempts] == [None, 8]
    assert [at.lost_steps for at in report.attempts] == [KILL_AT - 8, 0]
    assert report.failures == 1
    assert report.micros["lost"] > 0 and report.micros["checkpoint_restore"] > 0
    assert report.micros["checkpoint_save"] > 0 and report.micros["downtime"] > 0
    assert sum(report.micros.values()) == report.wall_us
    text = report_text(report)
    assert "failed" in text and "1 failure(s)" in text


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
