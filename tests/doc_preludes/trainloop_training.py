"""docs/integrations.md's TrainLoop example takes these from the reader's program: a model factory, a loss
function over a batch of token windows, and the run length."""

import torch

total_steps = 12


def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256))


def compute_loss(model, batch):
    tokens = batch["tokens"]
    return torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
