"""Transformers: CkptTrainer.train on a tiny local GPT-2 is SIGKILLed, resumed with resume_from_checkpoint=True,
and ends bitwise equal to an uninterrupted run; checkpoint-N folders follow HF's rotation; goodput is reported."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from kill_resume import assert_reported, assert_same_bits, losses, straight_killed_resumed  # noqa: E402

CHILD = Path(__file__).parent / "procs" / "hf_train.py"
STEPS, KILL_AT = 16, 10  # the child saves every 4 steps (save_total_limit=2): the resume is from step 8


def test_sigkill_resume_is_bitwise_and_reported(tmp_path):
    runs = straight_killed_resumed(CHILD, tmp_path, STEPS, KILL_AT)

    # 10 batches per epoch: the resume skips 8 batches of epoch 0, then crosses into epoch 1, all bit-exact
    reference = losses(runs.straight)
    assert losses(runs.killed) == {s: reference[s] for s in range(1, KILL_AT + 1)}
    assert losses(runs.resumed) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(runs.straight_npz, runs.resumed_npz)

    # HF's names and rotation are kept; the manager's steps follow the folders; no pickled files are written
    job = tmp_path / "job"
    assert sorted(p.name for p in job.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    assert sorted(p.name for p in (job / "ckpt").glob("step_*")) == ["step_00000012", "step_00000016"]
    assert sorted(p.name for p in (job / "checkpoint-16").iterdir()) == ["trainer_state.json"]
    assert json.loads((job / "checkpoint-16" / "trainer_state.json").read_text())["global_step"] == 16
    assert not list(job.rglob("*.pth")) and not list(job.rglob("*.bin"))

    assert_reported(job / "ckpt", restored=8, lost_steps=KILL_AT - 8)


def test_unsupported_configurations_fail_loudly(tmp_path):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from integrations.hf import CkptTrainer, checkpoint_step

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16, n_positions=8))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], load_best_model_at_end=True,
                             eval_strategy="steps", save_strategy="steps")
    with pytest.raises(NotImplementedError, match="load_best_model_at_end"):
        CkptTrainer(model=model, args=args, eval_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}])
    assert checkpoint_step(tmp_path / "checkpoint-12") == 12
    with pytest.raises(ValueError, match="not a checkpoint-N folder"):
        checkpoint_step(tmp_path / "step_12")
