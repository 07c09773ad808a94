"""Transformers under DDP: CkptTrainer.train on 2 CPU ranks (torchrun, gloo) is SIGKILLed on both ranks after its
last step, resumed with resume_from_checkpoint=True, and every rank trains the steps after the checkpoint again
bitwise as before: each rank's losses and final weights, with each rank's own RNG streams restored. Rank 0 writes the
checkpoint folders and follows HF's rotation; a save only one rank's SaveDecision asks for is made by every rank; the
goodput report shows the failure and the restore. Folder files with a local tier are refused (one rank cannot read
them back)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from ettr import attribute_root  # noqa: E402
from kill_resume import assert_same_bits, finish, start  # noqa: E402

CHILD = Path(__file__).parent / "procs" / "hf_train.py"
STEPS = 12  # the child saves every 4 steps and step 6 (save_total_limit=2); killed after step 12, before its save:
# resumes at 8


def by_rank(lines: list[list[str]]) -> dict[int, dict[int, str]]:
    """Rank -> step -> the loss (float hex) that rank printed for it (one micro-batch per step)."""
    out: dict[int, dict[int, str]] = {}
    for line in lines:
        if line[:1] == ["loss"]:
            out.setdefault(int(line[3]), {})[int(line[1])] = line[2]
    return out


def test_ddp_sigkill_resume_is_bitwise_on_every_rank(tmp_path):
    killed = start(CHILD, tmp_path / "job", tmp_path / "killed.npz", STEPS, hang_at=STEPS, ranks=2)
    killed_lines = finish(killed, ranks=2)
    assert killed.returncode != 0 and sum(line[:1] == ["hanging"] for line in killed_lines) == 2, killed_lines[-5:]
    job = tmp_path / "job"
    # step 6: asked for by rank 1's SaveDecision alone, saved by both ranks (rotation keeps the newest 2)
    assert sorted(p.name for p in (job / "ckpt").glob("step_*")) == ["step_00000006", "step_00000008"]
    resumed = start(CHILD, job, tmp_path / "resumed.npz", STEPS, ranks=2)
    resumed_lines = finish(resumed, ranks=2)
    assert resumed.returncode == 0 and resumed_lines.count(["done"]) == 2, resumed_lines[-5:]
    refused = "refused folder_files=True with a local tier (manager_options local=) among several processes".split()
    assert resumed_lines.count(refused) == 2, resumed_lines[:10]

    first, again = by_rank(killed_lines), by_rank(resumed_lines)
    assert first[0] != first[1]  # the ranks train other batches with other dropout: their losses differ
    for rank in (0, 1):
        assert sorted(first[rank]) == list(range(1, STEPS + 1)), first[rank]
        assert again[rank] == {s: first[rank][s] for s in range(9, STEPS + 1)}, f"rank {rank}"
        assert_same_bits(tmp_path / f"killed.rank{rank}.npz", tmp_path / f"resumed.rank{rank}.npz")

    assert sorted(p.name for p in job.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-8"]
    assert sorted(p.name for p in (job / "ckpt").glob("step_*")) == ["step_00000008", "step_00000012"]
    assert (job / "checkpoint-12" / "model.safetensors").is_file()
    report = attribute_root(str(job / "ckpt"))
    assert report.failures == 1, report
    assert [at.restored_step for at in report.attempts] == [None, 8]
    # HangAt runs before the goodput callback: step 12 never ended in the killed attempt; 9-11 are the ones replayed
    assert (report.replay.replayed, report.replay.equal, report.replay.diverged) == (3, 3, 0), report.replay
