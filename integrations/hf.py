"""Hugging Face Transformers adapters: a goodput TrainerCallback and a Trainer mixin that checkpoints through ckpt.

`CkptTrainerMixin` keeps the Trainer's own checkpoint logic (when to save, ``checkpoint-N`` folders with their
``trainer_state.json``, ``save_total_limit`` rotation, ``load_best_model_at_end``, ``resume_from_checkpoint=True|path``)
and moves the training state into a `CheckpointManager` root: model weights, optimizer, scheduler, scaler and every
RNG (`RNGState` instead of HF's pickled ``rng_state.pth``) are written asynchronously at step N of the root. Each
``checkpoint-N`` folder then gets its ``from_pretrained`` files (config, ``model.safetensors``, tokenizer) on a
background thread, read back from the committed step. The root is the source of truth: a resume reads the newest
committed step (or the one a ``checkpoint-N`` path names, falling back if N never committed) and rewrites
``checkpoint-N/trainer_state.json`` from it; a folder written by the stock Trainer is resumed by the stock Trainer's
own loading. A fresh ``train()`` into another run's root fails before anything is written (see `ckpt.run`). The
data order comes back through HF's own batch skipping (``ignore_data_skip=False``), with the RNG restored after the
skip, as HF does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, ContextManager

import safetensors.torch
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.training_args import OptimizerNames
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ckpt import CheckpointManager, RNGState, RunMismatchError, SaveDecision, SaveHandle
from ckpt import run as ckpt_run
from ckpt.distributed import leader_reads
from ckpt.exporter import model_config_metadata
from ckpt.options import RETENTION_KEYWORDS, RootOptions, TierOptions, typed
from ckpt.storage import open_storage
from ettr import GoodputTracker
from ettr.ledger import LEDGER_DIR

from ._common import (
    TrackerLease,
    check_decision,
    check_flag,
    delete_step,
    never_committed,
    read_step,
    refuse_rollback,
    resolve_step,
    save_once,
)

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_FILES_TMP = re.compile(rf"^\.{PREFIX_CHECKPOINT_DIR}-\d+\..+$")  # `_FolderFiles`' temporary folders
_STOCK_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth")  # what the stock Trainer writes and we never do
_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
# the ``args.optim`` choices HF's own create_optimizer builds over its decay/no-decay groups of the trainable
# parameters (GaLore, Apollo and LOMO, say, build groups of their own)
_DECAY_GROUPED = frozenset(
    {
        OptimizerNames.ADAMW_TORCH,
        OptimizerNames.ADAMW_TORCH_FUSED,
        OptimizerNames.ADAFACTOR,
        OptimizerNames.SGD,
        OptimizerNames.ADAGRAD,
        OptimizerNames.RMSPROP,
    }
)


class GoodputCallback(TrainerCallback):
    """Times each optimizer step (all its accumulation micro-batches) as goodput step ``global_step + 1``.

    Standalone, the caller starts and ends the tracker; `CkptTrainerMixin` adds one of these wired to its own, and
    hands it each micro-batch's loss (`add_loss`): their sum goes into the step's record, where a step trained again
    after a resume is compared with its first pass (docs/goodput.md, replay verification).
    """

    def __init__(self, tracker: GoodputTracker | None = None) -> None:
        self.tracker = tracker
        self._loss: Any = None

    def add_loss(self, loss: Any) -> None:
        """A micro-batch's loss (a tensor: summed on its device, read once at the step's end) of the open step."""
        loss = loss.detach() if hasattr(loss, "detach") else loss
        self._loss = loss if self._loss is None else self._loss + loss

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Open the step the coming optimizer step completes."""
        self._loss = None
        if self.tracker is not None:
            self.tracker.step_begin(state.global_step + 1)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Close it (global_step was just incremented) with its loss, if given."""
        loss, self._loss = self._loss, None
        if self.tracker is not None:
            self.tracker.step_end(state.global_step, loss)


def _load_whole(model: Any, state: dict[str, Any]) -> None:
    """``model.load_state_dict(state)``, refused before any tensor is copied when a key or a shape does not fit
    (torch copies every tensor that fits, then raises: a failed resume left the model half overwritten)."""
    own = model.state_dict()
    problems = [f"missing key {k!r}" for k in own if k not in state]
    problems += [f"unexpected key {k!r}" for k in state if k not in own]
    problems += [
        f"size mismatch for {k}: the checkpoint has shape {list(v.shape)}, the model {list(own[k].shape)}"
        for k, v in state.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    if problems:
        raise RuntimeError(
            f"cannot load the checkpoint into {type(model).__name__} (nothing was loaded): " + "; ".join(problems[:10])
        )
    model.load_state_dict(state)


def _check_groups(saved: dict[str, Any], mine: list[int], step: int, manager: CheckpointManager, loaded: str) -> None:
    """Refuse, naming the step, both sizes and what was `loaded`, an optimizer state whose parameter groups do not
    hold `mine` parameters each (torch's own refusal names neither: "loaded state dict contains a parameter group
    that doesn't match...")."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    theirs = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    if theirs is not None and theirs != mine:
        raise ValueError(
            f"step {step} of {manager.storage.url}: its optimizer state holds {theirs} parameters per group, this "
            f"trainer's optimizer {mine} (a parameter frozen, unfrozen or added since the save?). {loaded}"
        )


class SaveDecisionCallback(TrainerCallback):
    """Saves when a `ckpt.SaveDecision` says so (every T seconds, the advised interval, a preemption signal), by
    setting ``control.should_save`` after an optimizer step; HF's own ``save_strategy`` still saves too
    (``save_strategy="no"`` leaves the decision alone). Works on any Trainer; `CkptTrainerMixin` adds it for you.

    Every save, whatever asked for it, restarts the decision's intervals; so does the start of ``train()`` (a fresh
    start or the resumed step). Among several processes the ranks agree at each step (one all-reduce): every rank
    saves when any rank's decision says so (a time or a signal seen by one rank), as a save is collective.
    """

    def __init__(self, decision: SaveDecision, clock: Callable[[], float] = time.monotonic) -> None:
        self.decision, self.clock = check_decision(decision), clock

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.decision.saved(state.global_step, self.clock())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        due = self.decision.should_save(state.global_step, self.clock())
        if args.world_size > 1 and dist.is_initialized():
            flag = torch.tensor([int(due)], device=args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        if due:
            control.should_save = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.decision.saved(state.global_step, self.clock())


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step of a ``checkpoint-N`` folder path."""
    match = _CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(os.fspath(path))))
    if match is None:
        raise ValueError(f"{path} is not a {PREFIX_CHECKPOINT_DIR}-N folder written by CkptTrainerMixin")
    return int(match.group(1))


def is_stock_checkpoint(folder: str | os.PathLike[str]) -> bool:
    """Whether a ``checkpoint-N`` folder was written by the stock Trainer (it holds HF's optimizer/scheduler/RNG files)."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in _STOCK_STATE)


def _holds_state(folder: str) -> bool:
    """Whether a ``checkpoint-N`` folder holds training state: the stock Trainer's files or model weights. One whose
    step never committed holds neither (HF wrote its ``trainer_state.json``; the weights follow the commit)."""
    return is_stock_checkpoint(folder) or any(os.path.exists(os.path.join(folder, w)) for w in _WEIGHTS)


def _checkpoint_folders(run_dir: str) -> dict[int, str]:
    """Step -> path of the ``checkpoint-N`` folders in `run_dir`."""
    if not os.path.isdir(run_dir):
        return {}
    return {
        int(m.group(1)): os.path.join(run_dir, name)
        for name in os.listdir(run_dir)
        if (m := _CHECKPOINT_DIR.match(name)) and os.path.isdir(os.path.join(run_dir, name))
    }


class _FolderFiles:
    """Writes the ``from_pretrained`` files of checkpoint folders on one background thread, from committed steps.

    The weights are read back from the step just committed (verified, usually from the page cache) by a manager of
    its own, so nothing is copied on the training thread; `write` saves them into a temporary folder beside, whose
    files are moved into ``checkpoint-N`` under `lock` (the one HF's rotation holds), so a folder never gets files
    after it was rotated away. Errors are raised by the next `check` or `close`.
    """

    def __init__(
        self,
        root: str,
        tiers: TierOptions | None,
        root_options: RootOptions,
        write: Callable[[str, dict[str, Any]], None],
        lock: threading.Lock,
    ) -> None:
        # with the local tier, where most steps commit, and the root's storage_options (an object store's endpoint);
        # alone: among several processes only the writer of the folders (HF's `should_save`) reads them, the
        # replicated weights, whole
        self._reader = CheckpointManager(root, tiers=tiers, root_options=root_options, alone=True)
        self._write, self._lock = write, lock
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf-folder-files")
        self._pending: dict[int, Future] = {}

    def submit(self, handle: SaveHandle, folder: str) -> None:
        """Fill `folder` once the save behind `handle` is committed."""
        self._pending[handle.step] = self._pool.submit(self._run, handle, folder)

    def submit_state(self, step: int, folder: str, model_state: dict[str, Any]) -> None:
        """Fill `folder` of committed `step` from its model state, read already: a resumed step whose files a killed
        process never moved in (without them ``from_pretrained`` fails on that folder for good). A copy of the
        mapping is written: ``save_pretrained`` pops the tensors of the one it is given, which the resume loads."""
        self._pending[step] = self._pool.submit(self._fill, folder, dict(model_state))

    def busy(self, step: int) -> bool:
        """Whether the files of `step` are still being written (its step must not be deleted yet)."""
        future = self._pending.get(step)
        return future is not None and not future.done()

    def check(self) -> None:
        """Raise the error of a finished write: its save failed, or its files could not be written."""
        for step, future in list(self._pending.items()):
            if future.done():
                del self._pending[step]
                future.result()

    def close(self) -> None:
        """Wait for every write and release the thread and the reader; raises the first error."""
        try:
            futures_wait(list(self._pending.values()))
            self.check()
        finally:
            self._pool.shutdown(wait=True)
            self._reader.close()

    def _run(self, handle: SaveHandle, folder: str) -> None:
        handle.wait()
        state: dict[str, Any] = {"model": None}
        self._reader.restore(state, step=handle.step, keys=["model"], track=False)
        self._fill(folder, state["model"])

    def _fill(self, folder: str, model_state: dict[str, Any]) -> None:
        """Write the files into a temporary folder beside `folder`, then move them in (unless it was rotated away)."""
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=os.path.dirname(folder))
        try:
            self._write(tmp, model_state)
            with self._lock:
                if os.path.isdir(folder):
                    for name in os.listdir(tmp):
                        os.replace(os.path.join(tmp, name), os.path.join(folder, name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class CkptTrainerMixin:
    """Mixin before `transformers.Trainer`: saves and restores through a `CheckpointManager`, times goodput.

    ``class MyTrainer(CkptTrainerMixin, Trainer): ...`` then ``MyTrainer(..., ckpt_root=..., tracker=...)``.

    Args:
        ckpt_root: the manager's root (path or URL); default ``<output_dir>/ckpt``. Goodput ledgers go to ROOT/ettr.
        tracker: a started GoodputTracker managed by the caller; default: one per ``train()`` call, started at its
            entry and ended with "ok" or, when train() raises, "error".
        manager_options: passed to `CheckpointManager` (staging cap, chunk size). Retention follows HF's
            rotation: a step is deleted (in the background) once its ``checkpoint-N`` folder is gone and a newer
            step is committed; the manager's retention keywords (``keep_last=``...) are refused. Saves copy the
            whole state before they return (the manager's default, ``snapshot="sync"``): callbacks may change the
            weights between a save and the next optimizer step (an EMA swap, clipping through ``.data``). ``{"snapshot": "overlap"}`` opts in to copying the
            parameters and optimizer state beside the next forward and backward: a shorter stall, if nothing but
            ``optimizer.step()`` writes them before that step.
        run_id: this run's id (default: the launcher's, from the environment; see `ckpt.run`). A ``train()``
            without ``resume_from_checkpoint`` into a root holding committed steps resumes them silently when they
            are this run's (a torchrun restart, a requeue), and raises `ckpt.RunMismatchError` otherwise.
        overwrite: start over instead: such a fresh ``train()`` first deletes the other run (its committed steps,
            run record and goodput ledgers in the root, and the ``checkpoint-N`` folders in the output dir).
        folder_files: write ``config.json``, ``model.safetensors`` (and the tokenizer) into each ``checkpoint-N``
            folder in the background so that ``from_pretrained`` loads it; False leaves only ``trainer_state.json``.
        save_decision: a `ckpt.SaveDecision` that asks for saves besides HF's ``save_strategy`` (see
            `SaveDecisionCallback`), e.g. ``ckpt.EveryNSeconds(1800)`` or an advised interval.
        record_loss: put each step's loss (its micro-batches' ``training_step`` losses summed) into its goodput
            record, where a step trained again after a resume is compared with its first pass (docs/goodput.md,
            replay verification). Reading it on a GPU waits for the step's kernels once per step; False: not.
    One process, or several under DDP (torchrun): every rank saves and restores its part of each step (the
    replicated weights and optimizer written once, each rank's RNG streams its own); the process HF saves from
    (``should_save``) writes the ``checkpoint-N`` folders and rank 0 retains steps. No DeepSpeed or FSDP.
    """

    def __init__(
        self,
        *args: Any,
        ckpt_root: str | os.PathLike[str] | None = None,
        tracker: GoodputTracker | None = None,
        manager_options: dict[str, Any] | None = None,
        run_id: str | None = None,
        overwrite: bool = False,
        folder_files: bool = True,
        save_decision: SaveDecision | None = None,
        record_loss: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        trainer: Trainer = self
        unsupported = [
            name
            for name, on in (
                ("DeepSpeed", trainer.is_deepspeed_enabled),
                ("FSDP", trainer.is_fsdp_enabled),
            )
            if on
        ]
        if unsupported:
            raise NotImplementedError(
                f"CkptTrainerMixin supports one process or DDP, without {unsupported}; those paths save through HF's "
                f"own files"
            )
        # refused here, naming the argument: os.fspath(123) and {**"x"} named neither, and '' failed only in train()
        if ckpt_root is not None and not (isinstance(ckpt_root, (str, os.PathLike)) and os.fspath(ckpt_root)):
            raise TypeError(f"ckpt_root must be a path or URL, got {ckpt_root!r}")
        if manager_options is not None and not isinstance(manager_options, Mapping):
            raise TypeError(
                f"manager_options must be a dict of CheckpointManager keywords (e.g. {{'snapshot': 'overlap'}}), got "
                f"{manager_options!r}"
            )
        default_root = os.path.join(trainer.args.output_dir, "ckpt")
        self.ckpt_root = os.fspath(ckpt_root) if ckpt_root is not None else default_root
        self.ckpt_manager: CheckpointManager | None = None
        self.run_id = run_id
        self.overwrite, self.folder_files = check_flag("overwrite", overwrite), check_flag("folder_files", folder_files)
        self.record_loss = check_flag("record_loss", record_loss)
        # typed and checked now; the run id is the mixin's own (given or from the launcher)
        self._ckpt_options = typed({**(manager_options or {}), "run_id": run_id})
        retention = sorted(RETENTION_KEYWORDS & set(manager_options or {}))
        if retention:
            raise ValueError(
                f"manager_options {retention}: a CkptTrainer's steps follow HF's rotation (a step is deleted once its "
                f"checkpoint-N folder is rotated away), and a retention of the manager's own deleted steps whose "
                f"folders HF keeps (load_best_model_at_end's best step, a folder to resume from); set save_total_limit "
                f"in TrainingArguments instead"
            )
        if self.folder_files and self._ckpt_options["tiers"] is not None and trainer.args.world_size > 1:
            raise ValueError(
                "folder_files=True with a local tier (manager_options local=) among several processes: the folder "
                "files are read back on the saving process alone, which cannot read a step that each rank's local "
                "tier holds a part of before it is persisted; pass folder_files=False (restore the weights from the "
                "root, or `python -m ckpt export --format hf`), or leave out the local tier"
            )
        self._lease = TrackerLease(self.ckpt_root, tracker, self._ckpt_options["root_options"].storage_options)
        self._goodput = GoodputCallback()
        trainer.add_callback(self._goodput)
        if save_decision is not None:
            trainer.add_callback(SaveDecisionCallback(save_decision))
        self._staged: tuple[str, dict[str, Any]] | None = None  # (checkpoint folder, its restored state)
        self._stock: str | None = None  # a stock Trainer folder this train() resumes from
        self._done: set[int] = set()  # the steps this train() call saved or restored (`save_once`'s skip)
        self._saving = False
        self._folder_lock = threading.Lock()
        self._files: _FolderFiles | None = None

    # -- train(): the manager and the tracker live for one call --------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """HF's train(), with the manager opened around it and a resume resolved against the manager's root.

        Before anything is written: a fresh start into another run's root or checkpoint folders raises
        `ckpt.RunMismatchError` (or, with ``overwrite=True``, deletes that run); a restart of this run resumes. Then
        the root's writer lease is taken: a root another live process writes raises `ckpt.LeaseHeldError`.
        """
        # a step an earlier call saved is saved again by this one: that call's steps may have been deleted since
        # (overwrite=True, a rollback), and a step still committed is refused by the manager, not skipped
        self._done = set()
        manager = CheckpointManager(self.ckpt_root, **self._ckpt_options)
        try:  # decided by rank 0 alone (it claims the root, or deletes another run's), told to every rank
            resume = leader_reads(
                manager.ranks,
                lambda: self._start(manager, resume_from_checkpoint, trial),
                "decide what train() resumes",
            )
            # the root's writer lease now, as the first save would take it: a second writer of a live root (a
            # duplicate submit) fails here, before it trains, rotates the live job's folders or starts a ledger
            manager.hold_lease()
        except BaseException:
            manager.close()
            raise
        tracker = self._lease.start()
        self._goodput.tracker = manager.tracker = tracker
        self.ckpt_manager = manager
        if self.folder_files and self.args.should_save:
            options = self._ckpt_options
            self._files = _FolderFiles(
                self.ckpt_root, options["tiers"], options["root_options"], self._write_folder_files, self._folder_lock
            )
        try:
            path = self._resolve_resume(resume, trial)
            output = super().train(resume_from_checkpoint=path, trial=trial, **kwargs)
            # waiting for the last commit and its folder files is checkpoint time: a wait for the previous save
            with self._span("checkpoint_save", part="previous_wait"):
                self._finish_files()
                self._delete_rotated(self._get_output_dir(trial=trial))
                manager.close()
        except BaseException:
            for finish in (self._finish_files, manager.close):
                try:
                    finish()
                except Exception as e:  # noqa: BLE001 - the training exception is the one to report
                    warnings.warn(f"checkpoint write failed while train() was failing: {e}", RuntimeWarning)
            self._lease.end("error")
            raise
        finally:
            self._staged = self._stock = None
        self._lease.end("ok")
        return output

    def _start(self, manager: CheckpointManager, resume: str | bool | None, trial: Any) -> str | bool | None:
        """What this train() resumes from (None: nothing), decided before anything is written or deleted."""
        fresh = resume is None or resume is False
        run_dir = self._get_output_dir(trial=trial)
        try:
            same_run = ckpt_run.check_start(
                manager.storage,
                manager.run,
                resume=not fresh,
                how_to_resume="trainer.train(resume_from_checkpoint=True)",
                how_to_start_over="pass overwrite=True to the trainer (deletes that run), or use another "
                "output_dir/ckpt_root",
            )
            if not fresh:
                return resume if isinstance(resume, bool) else os.fspath(resume)
            if same_run:
                return True
            foreign = sorted(os.path.basename(p) for p in _checkpoint_folders(run_dir).values() if _holds_state(p))
            if foreign:
                raise RunMismatchError(
                    f"{run_dir} holds checkpoint folders {foreign} of another run, which a fresh train() would rotate "
                    f"away. Nothing was written or deleted. To resume that run: "
                    f"trainer.train(resume_from_checkpoint=True). To start over: pass overwrite=True to the trainer "
                    f"(deletes them), or use another output_dir"
                )
        except RunMismatchError:
            if not self.overwrite:
                raise
            self._start_over(manager, run_dir)
        return None

    def _start_over(self, manager: CheckpointManager, run_dir: str) -> None:
        """overwrite=True: delete the other run's steps, run record, goodput ledgers and checkpoint folders; only once
        this process holds the root's lease (a live writer's run is never deleted: `LeaseHeldError` names it)."""
        manager.hold_lease(collective=False)  # rank 0's alone: the other ranks wait for its decision
        steps = ckpt_run.discard(manager.storage)
        mine = self._lease.given.attempt_id if self._lease.given is not None else None  # a tracker you started
        for name in manager.storage.list_files(LEDGER_DIR):  # through the root's storage, with its storage_options
            if mine is None or mine not in os.path.basename(name):
                manager.storage.delete_file(f"{LEDGER_DIR}/{name}")
        folders = _checkpoint_folders(run_dir)
        for folder in folders.values():
            shutil.rmtree(folder)
        warnings.warn(
            f"overwrite=True: deleted the earlier run in {manager.storage.url} (steps {steps}, goodput "
            f"ledgers) and checkpoint folders {sorted(folders)} of {run_dir}",
            UserWarning,
            stacklevel=3,
        )

    def _resolve_resume(self, resume: str | bool | None, trial: Any) -> str | None:
        """Read the step to resume from (newest committed for True) and lay out its ``checkpoint-N`` folder;
        a stock Trainer folder (named, or the newest one when the root is empty) is passed on as it is. None: start
        fresh (nothing asked, or nothing to resume: `_without_steps`). Rank 0 finds the step, every rank reads it."""
        run_dir = self._get_output_dir(trial=trial)
        self._drop_files_tmp(run_dir)
        if resume is None:
            self._drop_uncommitted(run_dir, 0)
            return None
        found = leader_reads(
            self.ckpt_manager.ranks, lambda: self._resume_point(resume, run_dir), "find the step to resume"
        )
        if found is None:
            self._drop_uncommitted(run_dir, 0)
            return None
        if "stock" in found:
            return self._resume_stock(found["stock"])
        step = found["step"]
        self._drop_uncommitted(run_dir, step)
        staged = read_step(self.ckpt_manager, step)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        os.makedirs(folder, exist_ok=True)
        # each rank writes it (HF reads it on every rank, from a shared or a node's own output dir): whole or not at
        # all, as another rank may be reading it
        open_storage(folder).write_atomic(TRAINER_STATE, staged["trainer_state"].encode())
        if self._files is not None and not _holds_state(folder):
            self._files.submit_state(step, folder, staged["model"])
        self._staged = (os.path.abspath(folder), staged)
        self._done.add(step)
        return folder

    def _drop_files_tmp(self, run_dir: str) -> None:
        """Remove the temporary folders (``.checkpoint-N.*``) of folder files a killed process was writing: each holds
        a copy of the weights, which no one would ever move into place or delete. On the process that writes them."""
        if not self.args.should_save or not os.path.isdir(run_dir):
            return
        for name in os.listdir(run_dir):
            if _FILES_TMP.match(name) and os.path.isdir(os.path.join(run_dir, name)):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)

    def _drop_uncommitted(self, run_dir: str, after: int) -> None:
        """Remove the ``checkpoint-N`` folders after step `after` that a dead attempt left: their step never committed
        and they hold no state (HF's ``trainer_state.json`` alone). This train() saves those steps again into the same
        folder, which keeps its old mtime, so HF's rotation (oldest mtime first) took the fresh save for the oldest
        and deleted it. On the process HF saves from, as it rotates."""
        if not self.args.should_save:
            return
        committed = set(self.ckpt_manager.steps())
        for step, folder in _checkpoint_folders(run_dir).items():
            if step > after and step not in committed and not _holds_state(folder):
                shutil.rmtree(folder, ignore_errors=True)

    def _resume_point(self, resume: str | bool, run_dir: str) -> dict[str, Any] | None:
        """What a resume reads: ``{"step": N}`` of the root, ``{"stock": folder}`` (a stock Trainer folder), or None
        (a fresh start); a JSON value, as rank 0 tells it to the other ranks."""
        manager = self.ckpt_manager
        if resume is not True and not os.path.dirname(os.path.normpath(resume)):  # a bare name: one of ours
            resume = os.path.join(run_dir, resume)
        if resume is True:
            step = manager.latest_step()
            if step is None:
                return self._without_steps(run_dir, None)
            found: dict[str, Any] = {"step": int(step)}
        elif is_stock_checkpoint(resume):
            # HF resumes it at its trainer_state.json's step: a roll-back when the root committed later steps
            step = TrainerState.load_from_json(os.path.join(resume, TRAINER_STATE)).global_step
            found = {"stock": os.fspath(resume)}
        else:
            self._check_folder(os.fspath(resume), run_dir)
            step = resolve_step(manager, checkpoint_step(resume))
            if step is None:
                return self._without_steps(run_dir, os.fspath(resume))
            found = {"step": int(step)}
        refuse_rollback(manager, step, lambda _newest: ": train(resume_from_checkpoint=True)")
        return found

    def _check_folder(self, named: str, run_dir: str) -> None:
        """A named ``checkpoint-N`` folder must be one of this trainer's (a bare name is): another run's folder
        resumed this root's step N, whatever that folder held."""
        where = os.path.dirname(os.path.normpath(named))
        if where and os.path.realpath(where) != os.path.realpath(run_dir):
            raise ValueError(
                f"resume_from_checkpoint {named} is not a folder of this trainer's output_dir {run_dir} (a "
                f"{PREFIX_CHECKPOINT_DIR}-N path names step N of its ckpt_root {self.ckpt_manager.storage.url}): "
                f"name one of its folders, or pass True for the newest"
            )

    def _without_steps(self, run_dir: str, named: str | None) -> dict[str, Any] | None:
        """A resume (True, or the folder `named`) into a root with no committed step: HF's newest ``checkpoint-N``
        folder up to the named one, passing over folders that hold no state (their step never committed: the
        process died before its first save committed). A stock Trainer folder is resumed as it is; none at all is a
        fresh start (None, with a warning) when such folders were passed over, else the stock Trainer's ValueError.
        A folder holding weights but no step, or one newer than the named folder holding state, raises: neither a
        fresh start nor an older folder may pass over it. Returns as `_resume_point`."""
        root = self.ckpt_manager.storage.url
        folders = _checkpoint_folders(run_dir)
        upto = checkpoint_step(named) if named is not None else None
        if named is not None:
            if not os.path.isdir(named):
                raise FileNotFoundError(f"{named} does not exist and no step of {root} is committed")
            folders[upto] = named
            newer = sorted(os.path.basename(p) for s, p in folders.items() if s > upto and _holds_state(p))
            if newer:
                raise FileNotFoundError(
                    f"{never_committed(self.ckpt_manager, upto, named)}, while {newer} in {run_dir} hold training "
                    f"state: resume one of them (resume_from_checkpoint=True for the newest)"
                )
        passed = []
        for step in sorted((s for s in folders if upto is None or s <= upto), reverse=True):
            folder = folders[step]
            if is_stock_checkpoint(folder):
                if passed:
                    warnings.warn(
                        f"{sorted(passed)} hold no training state and no step of {root} is committed (their saves "
                        f"died): resuming from the stock Trainer's {folder} instead",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                return {"stock": folder}
            if _holds_state(folder):
                raise ValueError(
                    f"{folder} holds model weights but no step of {root} is committed (its root was deleted or "
                    f"moved, or it belongs to another root): nothing to resume it from"
                )
            passed.append(os.path.basename(folder))
        if not passed:
            raise ValueError(f"No valid checkpoint found in {root} or {run_dir}")
        what = (
            never_committed(self.ckpt_manager, upto, named)
            if named is not None
            else f"{run_dir} holds {sorted(passed)}, whose steps never committed, and no step of {root} is committed "
            f"(the process died before its first save committed)"
        )
        warnings.warn(f"{what}: nothing to resume, train() starts fresh", RuntimeWarning, stacklevel=4)
        return None

    def _resume_stock(self, folder: str) -> str:
        """Resume from a folder the stock Trainer wrote: its own loading reads it (torch.load with weights_only)."""
        self._stock = os.path.abspath(folder)
        return folder

    def _is_stock(self, checkpoint: str | None) -> bool:
        return checkpoint is not None and self._stock == os.path.abspath(checkpoint)

    def _staged_for(self, checkpoint: str) -> dict[str, Any]:
        """The restored state of a ``checkpoint-N`` folder (read now if train() did not resolve it)."""
        if self._staged is not None and self._staged[0] == os.path.abspath(checkpoint):
            return self._staged[1]
        if self.ckpt_manager is None:
            raise RuntimeError("CkptTrainerMixin loads checkpoints inside train() only (the manager is opened there)")
        step = resolve_step(self.ckpt_manager, checkpoint_step(checkpoint))
        if step is None:
            raise FileNotFoundError(never_committed(self.ckpt_manager, checkpoint_step(checkpoint), checkpoint))
        staged = read_step(self.ckpt_manager, step)
        self._staged = (os.path.abspath(checkpoint), staged)
        return staged

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """HF's, its loss also handed to the goodput step (`GoodputCallback.add_loss`) unless ``record_loss=False``."""
        loss = super().training_step(*args, **kwargs)
        if self.record_loss:
            self._goodput.add_loss(loss)
        return loss

    def _span(self, category: str, **attrs: Any) -> ContextManager[Any]:
        """A span of the train() call's tracker (none outside train())."""
        tracker = self._goodput.tracker
        return tracker.span(category, **attrs) if tracker is not None else contextlib.nullcontext()

    # -- loading: HF's hooks, fed from the restored state -------------------------------------------------------
    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        """HF's (epochs trained, batches to skip), with no epoch left to run once the resumed step reached
        `max_steps`: HF's loop resuming mid-epoch trains one step before it checks max_steps (a finished run
        restarted trained, saved and rotated a step past its end)."""
        epochs, skip = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        trainer: Trainer = self
        return (num_train_epochs, 0) if trainer.state.global_step >= max_steps else (epochs, skip)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Model weights from the manager instead of model.safetensors (a stock folder: HF's own loading). HF loads
        them before it builds the optimizer: a saved optimizer state whose groups will not fit it (when they can be
        told now, `_optimizer_groups`) is refused first, so that the refusal leaves the weights as they were."""
        if self._is_stock(resume_from_checkpoint):
            with self._span("checkpoint_restore"):
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
        staged = self._staged_for(resume_from_checkpoint)
        groups = self._optimizer_groups()
        if "optimizer" in staged and groups is not None:
            step = checkpoint_step(resume_from_checkpoint)
            _check_groups(staged["optimizer"], groups, step, self.ckpt_manager, "Nothing was loaded")
        _load_whole(model if model is not None else self.model, staged["model"])

    def _optimizer_groups(self) -> list[int] | None:
        """The parameters per group of the optimizer a resume loads into: this trainer's (passed to it, or built by
        HF), else the one HF's create_optimizer will build (for the `_DECAY_GROUPED` choices of ``args.optim``): one
        group of the model's trainable parameters that get weight decay, one of the others. None when neither: a
        subclass's create_optimizer, ``optimizer_cls_and_kwargs`` or another ``args.optim`` builds its own groups."""
        trainer: Trainer = self
        if trainer.optimizer is not None:
            return [len(g["params"]) for g in trainer.optimizer.param_groups]
        if (
            type(self).create_optimizer is not Trainer.create_optimizer
            or trainer.optimizer_cls_and_kwargs is not None
            or trainer.args.optim not in _DECAY_GROUPED
        ):
            return None
        decay = set(trainer.get_decay_parameter_names(trainer.model))
        trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
        return [sum(n in decay for n in trainable), sum(n not in decay for n in trainable)]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Optimizer and LR scheduler from the manager (absent when saved with save_only_model)."""
        if checkpoint is None or self._is_stock(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        staged = self._staged_for(checkpoint)
        if "optimizer" in staged:
            _check_groups(
                staged["optimizer"],
                self._optimizer_groups(),
                checkpoint_step(checkpoint),
                self.ckpt_manager,
                "The model's weights were loaded already (HF loads them before it builds the optimizer, whose groups "
                "could not be told then); the optimizer and LR scheduler were not",
            )
            self.optimizer.load_state_dict(staged["optimizer"])
            self.lr_scheduler.load_state_dict(staged["lr_scheduler"])
        else:  # HF resumes such a folder in silence; the run goes on as another one
            warnings.warn(
                f"step {checkpoint_step(checkpoint)} of {self.ckpt_manager.storage.url} holds no optimizer or LR "
                f"scheduler state (saved with save_only_model=True): both start over (a fresh optimizer, the LR "
                f"schedule back at its step 0), so the resumed run is not the one that never stopped",
                RuntimeWarning,
                stacklevel=2,
            )

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The AMP grad scaler, when there is one."""
        if self._is_stock(checkpoint):
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and "scaler" in self._staged_for(checkpoint):
            scaler.load_state_dict(self._staged_for(checkpoint)["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Every RNG through RNGState; HF calls this after skipping the trained batches, so the order is exact."""
        if self._is_stock(checkpoint):
            return super()._load_rng_state(checkpoint)
        if checkpoint is not None and "rng" in self._staged_for(checkpoint):
            RNGState().load_state_dict(self._staged_for(checkpoint)["rng"])

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best step's weights from the manager (not a resume: kept out of the ledger)."""
        best = self.state.best_model_checkpoint
        if is_stock_checkpoint(best):
            return super()._load_best_model()
        with self._span("checkpoint_restore"):
            self.ckpt_manager.restore({"model": self.model}, step=checkpoint_step(best), keys=["model"], track=False)

    # -- saving: HF writes trainer_state.json and rotates; the rest goes to the manager --------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's checkpoint (folder, trainer_state.json, rotation) without its weight/optimizer/RNG files, then an
        async save of step N to the manager, its folder files queued, and the deletion of steps whose folders HF
        rotated away queued; all of it timed as checkpoint_save."""
        step = self.state.global_step
        with self._span("checkpoint_save", step=step):
            if self._files is not None:
                self._files.check()
            self._saving = True
            try:
                with self._folder_lock:
                    super()._save_checkpoint(model, trial)
            finally:
                self._saving = False
            run_dir = self._get_output_dir(trial=trial)
            folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
            state: dict[str, Any] = {
                "model": self.model,
                "trainer_state": self._trainer_state(folder),
                "rng": RNGState(),
            }
            if not self.args.save_only_model:
                state.update(optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    state["scaler"] = scaler
            metadata = model_config_metadata(self.model)  # the config `python -m ckpt export --format hf` writes
            handle = save_once(self.ckpt_manager, step, state, skip=tuple(self._done), metadata=metadata)
            if handle is not None:
                self._done.add(step)
                if self._files is not None:
                    self._files.submit(handle, folder)
            self._delete_rotated(run_dir)

    def _trainer_state(self, folder: str) -> str:
        """The ``trainer_state.json`` HF just wrote into `folder`, as a resume writes it back. Only the process HF
        saves from writes it, and a step's values are rank 0's (`CheckpointManager.save`): another rank's are not
        kept, so it gives an empty string, read by no one."""
        if not self.args.should_save:
            return ""
        with open(os.path.join(folder, TRAINER_STATE), encoding="utf-8") as f:
            return f.read()

    def _delete_rotated(self, run_dir: str) -> None:
        """Queue the deletion of steps whose folders HF rotated away (not the newest, not one being exported): on
        rank 0, which deletes for every rank."""
        if not self.is_world_process_zero():
            return
        folders = _checkpoint_folders(run_dir)
        for old in self.ckpt_manager.steps():
            if old not in folders and not (self._files is not None and self._files.busy(old)):
                delete_step(self.ckpt_manager, old)

    def _finish_files(self) -> None:
        """Wait for the folder files still being written (raises their error)."""
        files, self._files = self._files, None
        if files is not None:
            files.close()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """Folder files are complete before HF loads the best model and removes folders at the end of training."""
        with self._span("checkpoint_save", part="previous_wait"):
            self._finish_files()
        return super()._finalize_training(*args, **kwargs)

    def _write_folder_files(self, folder: str, model_state: dict[str, Any]) -> None:
        """What the stock Trainer's save_model writes for from_pretrained, from a restored state dict (background)."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(folder, state_dict=model_state)
        else:
            safetensors.torch.save_file(model_state, os.path.join(folder, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF's save_model (a from_pretrained export); in a checkpoint only the folder: its files come afterwards."""
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
