"""Child process: a tiny Lightning fit through CkptCheckpointIO + GoodputCallback, resumed from "last".

Usage: lightning_train.py ROOT OUT.npz MAX_STEPS [HANG_AT]
Prints "loss STEP HEX" and "batch STEP I,J,..." (the dataset indices) per step; with HANG_AT it drains the saves after that step, prints "hanging" and sleeps
(the test SIGKILLs it). Otherwise it writes the final weights to OUT.npz and prints "done". With PERTURB_STEP in the
environment, that step's loss is nudged (a divergence for the replay check to find).
"""

import gc
import os
import sys
import time

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

from ckpt import ShuffledSampler, make_loader
from integrations.lightning import CkptCheckpointIO, GoodputCallback


class Points(Dataset):
    """64 fixed random regression points."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Net(LightningModule):
    """MLP with dropout (global torch RNG), Adam and a step LR schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"hidden": 32, "activation": torch.nn.ReLU()})  # the module is dropped on save
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = torch.nn.functional.mse_loss(self.net(x + 0.01 * torch.randn_like(x)), y)
        if self.global_step + 1 == int(os.environ.get("PERTURB_STEP", "0")):
            loss = loss * (1 + 2**-10)
        print(f"loss {self.global_step + 1} {loss.item().hex()}", flush=True)
        print(f"batch {self.global_step + 1} {','.join(map(str, index.tolist()))}", flush=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"},
        }


class HangAt(Callback):
    """After step `at`: make the saves durable and the ledger current, then wait to be killed."""

    def __init__(self, at: int, io: CkptCheckpointIO, goodput: GoodputCallback) -> None:
        self.at, self.io, self.goodput = at, io, goodput

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.io.wait()
            self.goodput.tracker.flush()
            print("hanging", flush=True)
            time.sleep(600)


def main(root: str, out: str, max_steps: int, hang_at: int | None) -> None:
    torch.manual_seed(0)
    sampler = ShuffledSampler(64, 8, seed=1)
    io = CkptCheckpointIO(root)
    goodput = GoodputCallback(samplers={"train": sampler})
    callbacks = [
        goodput,
        ModelCheckpoint(dirpath=os.path.join(root, "pointers"), every_n_train_steps=4, save_last=True),
    ]
    if hang_at is not None:
        callbacks.insert(1, HangAt(hang_at, io, goodput))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
        plugins=[io],
        callbacks=callbacks,
    )
    model = Net()
    trainer.fit(model, train_dataloaders=make_loader(Points(), sampler), ckpt_path="last")
    np.savez(out, **{k: v.numpy() for k, v in model.state_dict().items()})
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s)
