"""docs/integrations.md's Lightning example takes these from the reader's program: a map-style dataset and
a LightningModule."""

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import TensorDataset

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))


class Regressor(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


model = Regressor()
