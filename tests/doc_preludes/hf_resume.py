"""The HF examples (README.md, docs/integrations.md) resume a run: this gives them a tiny GPT-2 (`model`), a dataset
(`ds`) and a first run of 4 steps committed to out/ckpt, as the attempt that crashed would have left it. No launcher
run id is set (CKPT_RUN_ID, SLURM_JOB_ID, TORCHELASTIC_RUN_ID), as on a workstation: the restart is a run of its own,
which resumes through resume_from_checkpoint=True (a plain train() would be refused with RunMismatchError)."""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from integrations.hf import CkptTrainer

for var in ("CKPT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
    os.environ.pop(var, None)
torch.manual_seed(0)
ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16))]
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
CkptTrainer(
    model=model,
    args=TrainingArguments(output_dir="out", save_steps=4, max_steps=4, disable_tqdm=True),
    train_dataset=ds,
).train()
