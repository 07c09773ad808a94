"""docs/goodput.md's examples take these from the reader's program: the root, the state, an endless loader,
a training function and the run length."""

import torch

root = "runs/goodput"
total = 1000
model = torch.nn.Linear(8, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.01)
state = {"model": model, "optim": optim}
loader = iter(lambda: torch.randn(4, 8), None)  # endless: next(loader) is a batch


def train(batch):
    loss = model(batch).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
