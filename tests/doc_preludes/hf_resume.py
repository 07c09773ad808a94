"""docs/integrations.md's HF example resumes a run: this gives it a tiny GPT-2 (`model`), a dataset (`ds`) and
a first run of 4 steps committed to out/ckpt, as the attempt that crashed would have left it. The launcher's run
id (CKPT_RUN_ID here; SLURM_JOB_ID or TORCHELASTIC_RUN_ID on a cluster) is what makes the example a restart."""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from integrations.hf import CkptTrainer

os.environ["CKPT_RUN_ID"] = "doc-hf-run"
torch.manual_seed(0)
ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16))]
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
CkptTrainer(
    model=model,
    args=TrainingArguments(output_dir="out", save_steps=4, max_steps=4, disable_tqdm=True),
    train_dataset=ds,
).train()
