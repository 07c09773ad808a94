"""Hugging Face Transformers adapters: a goodput TrainerCallback and a Trainer mixin that checkpoints through ckpt.

`CkptTrainerMixin` keeps the Trainer's own checkpoint logic (when to save, ``checkpoint-N`` folders with their
``trainer_state.json``, ``save_total_limit`` rotation, ``resume_from_checkpoint=True|path``) and moves the heavy
parts into a `CheckpointManager` root: model weights, optimizer, scheduler, scaler and every RNG (`RNGState`
instead of HF's pickled ``rng_state.pth``) are written asynchronously at step N of the root. The root is the
source of truth: a resume reads the newest committed step (or the one a ``checkpoint-N`` path names, falling back
if N never committed) and rewrites ``checkpoint-N/trainer_state.json`` from it. The data order comes back through
HF's own batch skipping (``ignore_data_skip=False``), with the RNG restored after the skip, as HF does.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckpt import CheckpointManager
from ckpt.exporter import model_config_metadata
from ckpt.rng import RNGState
from ettr import GoodputTracker

from ._common import TrackerLease, delete_step, read_step, resolve_step, save_once

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class GoodputCallback(TrainerCallback):
    """Times each optimizer step (all its accumulation micro-batches) as goodput step ``global_step + 1``.

    Standalone, the caller starts and ends the tracker; `CkptTrainerMixin` adds one of these wired to its own.
    """

    def __init__(self, tracker: GoodputTracker | None = None) -> None:
        self.tracker = tracker

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """Open the step the coming optimizer step completes."""
        if self.tracker is not None:
            self.tracker.step_begin(state.global_step + 1)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Close it (global_step was just incremented)."""
        if self.tracker is not None:
            self.tracker.step_end(state.global_step)


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step of a ``checkpoint-N`` folder path."""
    match = _CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(os.fspath(path))))
    if match is None:
        raise ValueError(f"{path} is not a {PREFIX_CHECKPOINT_DIR}-N folder written by CkptTrainerMixin")
    return int(match.group(1))


class CkptTrainerMixin:
    """Mixin before `transformers.Trainer`: saves and restores through a `CheckpointManager`, times goodput.

    ``class MyTrainer(CkptTrainerMixin, Trainer): ...`` then ``MyTrainer(..., ckpt_root=..., tracker=...)``.

    Args:
        ckpt_root: the manager's root (path or URL); default ``<output_dir>/ckpt``. Goodput ledgers go to ROOT/ettr.
        tracker: a started GoodputTracker managed by the caller; default: one per ``train()`` call, started at its
            entry and ended with "ok" or, when train() raises, "error".
        manager_options: passed to `CheckpointManager` (staging cap, chunk size). Retention follows HF's
            rotation: a step is deleted once its ``checkpoint-N`` folder is gone and a newer step is committed.
    Single process only (no DeepSpeed, FSDP or multi-process runs); ``load_best_model_at_end`` is not supported.
    """

    def __init__(self, *args: Any, ckpt_root: str | os.PathLike[str] | None = None,
                 tracker: GoodputTracker | None = None, manager_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        trainer: Trainer = self
        unsupported = [name for name, on in (
            ("DeepSpeed", trainer.is_deepspeed_enabled), ("FSDP", trainer.is_fsdp_enabled),
            (f"world_size={trainer.args.world_size}", trainer.args.world_size > 1),
            ("load_best_model_at_end", trainer.args.load_best_model_at_end)) if on]
        if unsupported:
            raise NotImplementedError(f"CkptTrainerMixin supports single-process training without {unsupported}; "
                                      f"those paths save through HF's own files")
        default_root = os.path.join(trainer.args.output_dir, "ckpt")
        self.ckpt_root = os.fspath(ckpt_root) if ckpt_root is not None else default_root
        self.ckpt_manager: CheckpointManager | None = None
        self._ckpt_options = dict(manager_options or {})
        self._lease = TrackerLease(self.ckpt_root, tracker)
        self._goodput = GoodputCallback()
        trainer.add_callback(self._goodput)
        self._staged: tuple[str, dict[str, Any]] | None = None  # (checkpoint folder, its restored state)
        self._done: set[int] = set()
        self._saving = False

    # -- train(): the manager and the tracker live for one call --------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """HF's train(), with the manager opened around it and a resume resolved against the manager's root."""
        tracker = self._lease.start()
        self._goodput.tracker = tracker
        self.ckpt_manager = CheckpointManager(self.ckpt_root, tracker=tracker, **self._ckpt_options)
        try:
            path = self._resolve_resume(resume_from_checkpoint, trial)
            output = super().train(resume_from_checkpoint=path, trial=trial, **kwargs)
            self.ckpt_manager.close()
        except BaseException:
            try:
                self.ckpt_manager.close()
            except Exception as e:  # noqa: BLE001 - the training exception is the one to report
                warnings.warn(f"checkpoint write failed while train() was failing: {e}", RuntimeWarning)
            self._lease.end("error")
            raise
        finally:
            self._staged = None
        self._lease.end("ok")
        return output

    def _resolve_resume(self, resume: str | bool | None, trial: Any) -> str | None:
        """Read the step to resume from (newest committed for True) and lay out its ``checkpoint-N`` folder."""
        if resume is None or resume is False:
            return None
        manager = self.ckpt_manager
        if resume is True:
            step = manager.latest_step()
            if step is None:
                raise ValueError(f"No valid checkpoint found in {manager.storage.url}")
        else:
            step = resolve_step(manager, checkpoint_step(resume))
        staged = read_step(manager, step)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(staged["trainer_state"])
        self._staged = (os.path.abspath(folder), staged)
        self._done.add(step)
        return folder

    def _staged_for(self, checkpoint: str) -> dict[str, Any]:
        """The restored state of a ``checkpoint-N`` folder (read now if train() did not resolve it)."""
        if self._staged is not None and self._staged[0] == os.path.abspath(checkpoint):
            return self._staged[1]
        if self.ckpt_manager is None:
            raise RuntimeError("CkptTrainerMixin loads checkpoints inside train() only (the manager is opened there)")
        staged = read_step(self.ckpt_manager, resolve_step(self.ckpt_manager, checkpoint_step(checkpoint)))
        self._staged = (os.path.abspath(checkpoint), staged)
        return staged

    # -- loading: HF's hooks, fed from the restored state -------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Model weights from the manager instead of model.safetensors."""
        (model if model is not None else self.model).load_state_dict(self._staged_for(resume_from_checkpoint)["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer and LR scheduler from the manager (absent when saved with save_only_model)."""
        if checkpoint is None:
            return
        staged = self._staged_for(checkpoint)
        if "optimizer" in staged:
            self.optimizer.load_state_dict(staged["optimizer"])
            self.lr_scheduler.load_state_dict(staged["lr_scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The AMP grad scaler, when there is one."""
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and "scaler" in self._staged_for(checkpoint):
            scaler.load_state_dict(self._staged_for(checkpoint)["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Every RNG through RNGState; HF calls this after skipping the trained batches, so the order is exact."""
        if checkpoint is not None and "rng" in self._staged_for(checkpoint):
            RNGState().load_state_dict(self._staged_for(checkpoint)["rng"])

    # -- saving: HF writes trainer_state.json and rotates; the rest goes to the manager --------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's checkpoint (folder, trainer_state.json, rotation) without its weight/optimizer/RNG files, then an
        async save of step N to the manager and the deletion of steps whose folders HF rotated away."""
        self._saving = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving = False
        step = self.state.global_step
        run_dir = self._get_output_dir(trial=trial)
        with open(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}", TRAINER_STATE), encoding="utf-8") as f:
            state: dict[str, Any] = {"model": self.model, "trainer_state": f.read(), "rng": RNGState()}
        if not self.args.save_only_model:
            state.update(optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        metadata = model_config_metadata(self.model)  # the config `python -m ckpt export --format hf` writes
        if save_once(self.ckpt_manager, step, state, skip=tuple(self._done), metadata=metadata):
            self._done.add(step)
        folders = {int(m.group(1)) for name in os.listdir(run_dir) if (m := _CHECKPOINT_DIR.match(name))}
        for old in self.ckpt_manager.steps():
            if old not in folders:
                delete_step(self.ckpt_manager, old)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF's save_model (a from_pretrained export); in a checkpoint only the folder: the manager has the weights."""
        if self._saving and output_dir is not None:
            os.makedirs(output_dir, exist_ok=True)
        else:
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: the optimizer and scheduler are in the manager's step."""

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the scaler is in the manager's step."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing: RNGState is in the manager's step (no pickled rng_state.pth)."""


class CkptTrainer(CkptTrainerMixin, Trainer):
    """`transformers.Trainer` that checkpoints through ckpt and measures goodput."""
