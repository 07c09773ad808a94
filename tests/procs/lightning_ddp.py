"""Child process: a Lightning DDP fit (2 CPU ranks, gloo; Lightning re-runs this script for rank 1) through
CkptCheckpointIO + GoodputCallback + ModelCheckpoint(every 2 steps, last), resumed from "last".

Usage: lightning_ddp.py ROOT MAX_STEPS [split | decide | sampled [skip | advance]]
("split": rank 1 uses ROOT-rank1 as its root and pointer folder, as a node-local disk would; "decide": a
DecisionCheckpoint into ROOT/decided whose decision asks for a save at step 6 on rank 1 alone; "sampled": the data
through a ckpt ShuffledSampler given to GoodputCallback, whose rank 1 skips item 3 ("skip") or counts step 3's batch
twice ("advance").)
Every rank prints "start RANK STEP HEX" (its weights as the training starts: after a resume, the restored ones) and
"end RANK STEP HEX" (after the fit), HEX being the float32 bytes of every parameter in order.
"""

import gc
import os
import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ckpt import ShuffledSampler, make_loader
from integrations.lightning import CkptCheckpointIO, DecisionCheckpoint, GoodputCallback


class Net(LightningModule):
    """A linear regression with Adam: its moments are part of what every rank must restore."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def weights(module: torch.nn.Module) -> str:
    return b"".join(p.detach().numpy().tobytes() for p in module.parameters()).hex()


def say(line: str) -> None:
    """One write(2) of the whole line: both ranks share the pipe, and a print may split a line into two writes."""
    os.write(1, (line + "\n").encode())


class Report(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        say(f"start {trainer.global_rank} {trainer.global_step} {weights(pl_module)}")


class Rank1AtStep6:
    """A `ckpt.SaveDecision` that asks for a save at step 6 on rank 1 alone (as a signal seen by one node would)."""

    def should_save(self, step: int, now: float) -> bool:
        return step == 6 and os.environ.get("LOCAL_RANK", "0") == "1"

    def saved(self, step: int, now: float) -> None:
        pass


class AdvanceOnce(Callback):
    """Rank 1 counts step 3's batch twice (after the save of step 2): its sampler's position is no longer rank 0's."""

    def __init__(self, sampler: ShuffledSampler) -> None:
        self.sampler, self.done = sampler, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3 and not self.done:
            self.sampler.advance()
            self.done = True


def main(root: str, max_steps: int, modes: list[str]) -> None:
    split, decide, sampled = "split" in modes, "decide" in modes, "sampled" in modes
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning starts rank 1 with LOCAL_RANK set
    if split and rank == 1:
        root += "-rank1"
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    sampler = ShuffledSampler(64, 8, seed=1, rank=rank, world_size=2)
    if "skip" in modes and rank == 1:
        sampler.skip([3])
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=not sampled,  # Lightning cannot put its own sampler into a ckpt one
        plugins=[CkptCheckpointIO(root, collective_timeout=10)],  # a rank waiting for another fails in 10 s
        callbacks=[
            GoodputCallback(samplers={"train": sampler} if sampled else None),
            ModelCheckpoint(dirpath=os.path.join(root, "pointers"), every_n_train_steps=2, save_last=True),
            Report(),
            *([DecisionCheckpoint(Rank1AtStep6(), dirpath=os.path.join(root, "decided"), every_n_epochs=0)] * decide),
            *([AdvanceOnce(sampler)] * ("advance" in modes)),
        ],
    )
    model = Net()
    loader = make_loader(data, sampler) if sampled else DataLoader(data, batch_size=4)
    trainer.fit(model, loader, ckpt_path="last")
    say(f"end {trainer.global_rank} {trainer.global_step} {weights(model)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    gc.freeze()  # the child ends here: no final collections over torch's objects
