"""README.md's example takes these from the reader's program: a tiny byte-level model, its optimizer and
scheduler, a token dataset with its sampler, a step function returning the loss, and the run length."""

import torch

from ckpt import RandomWindowSampler, TokenWindowDataset

dataset = TokenWindowDataset("tokens.bin", "uint16", window=33, seed=0)
sampler = RandomWindowSampler(dataset.n_tokens, 33, 16, global_batch_size=8, seed=0, fingerprint=dataset.fingerprint())
model = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
total_steps = 300


def train_step(batch):
    tokens = batch["tokens"]
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()
