"""Lightning with ckpt + ettr: a fit that fails at step 10, a restarted process that resumes from step 8, the report.

Run: python examples/lightning_example.py [RUN_DIR]   (offline, seconds on a CPU; each attempt is its own process;
without RUN_DIR the run goes to a temp dir, removed at the end)
"""

import argparse
import subprocess
import sys
import tempfile

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

import ettr
from ckpt import ShuffledSampler, make_loader
from integrations.lightning import CkptCheckpointIO, GoodputCallback


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class FailAt(Callback):
    """Simulates a crash (a bad node, an OOM) after some step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated failure after step {self.step}")


def fit(root: str, max_steps: int, fail_at: int | None) -> None:
    """One process attempt: resume from the newest checkpoint (if any) and train up to `max_steps`."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    sampler = ShuffledSampler(len(data), global_batch_size=8, seed=0)  # its position is saved by the callback
    trainer = Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[CkptCheckpointIO(root)],  # async saves, no pickle
        callbacks=[
            GoodputCallback(samplers={"train": sampler}),  # timing, RNG, sampler position
            ModelCheckpoint(dirpath=f"{root}/pointers", every_n_train_steps=4, save_last=True),
        ]
        + ([FailAt(fail_at)] if fail_at else []),
    )
    trainer.fit(Regressor(), make_loader(data, sampler), ckpt_path="last")


def run(root: str) -> None:
    """Two process attempts into `root` (the first fails after step 10, the restart finishes), then the report."""
    for fail_at in (10, 0):
        done = subprocess.run([sys.executable, __file__, "--attempt", root, str(fail_at)], capture_output=True)
        if done.returncode and b"simulated failure after step" not in done.stderr:  # any other failure is real
            sys.exit(f"attempt failed (exit status {done.returncode}):\n{done.stderr.decode()[-4000:]}")
    print(ettr.report_text(ettr.attribute_root(root)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attempt"]:
        fit(sys.argv[2], 16, int(sys.argv[3]) or None)
        sys.exit()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", default=None, help="the checkpoint root (default: a temp dir, removed after)")
    run_dir = p.parse_args().run_dir
    if run_dir is not None:
        run(run_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="lightning-example-") as root:
            run(root)
