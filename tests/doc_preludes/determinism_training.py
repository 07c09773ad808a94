"""docs/determinism.md's example takes these from the reader's program: an augmentation, two registered
generators, a model and optimizer whose step draws from them, a logger, the root and the run length."""

import logging

import numpy as np
import torch

log = logging.getLogger("train")
root = "runs/determinism"
total_steps, every = 4, 2
dropout_gen = torch.Generator().manual_seed(1)
mask_rng = np.random.default_rng(2)
model = torch.nn.Linear(64, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.01)


def augment(tokens, rng):
    """Zero 10% of the tokens, drawn from the sample's own generator (the same on every resume)."""
    tokens = tokens.astype(np.int64)
    tokens[rng.random(len(tokens)) < 0.1] = 0
    return torch.from_numpy(tokens)


def train_step(batch):
    x = batch["tokens"][:, :64].float() / 256
    keep = torch.rand(x.shape, generator=dropout_gen) > float(mask_rng.uniform(0.05, 0.15))
    loss = model(x * keep).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
