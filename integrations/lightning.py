"""PyTorch Lightning adapters: a CheckpointIO plugin writing through ckpt asynchronously, and a goodput Callback.

`CkptCheckpointIO` turns every ``*.ckpt`` path Lightning asks for into a tiny JSON pointer to a step of one
`CheckpointManager` root; the checkpoint dict itself is written asynchronously (no pickle). `GoodputCallback`
times each training batch as a goodput step, marks an exception as a disruption, and carries the RNG state and
the positions of `ckpt` samplers in its own ``state_dict``, which is what makes a resume bitwise exact.
`DecisionCheckpoint` is a ``ModelCheckpoint`` that also saves when a `ckpt.SaveDecision` says so.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import posixpath
import re
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch import __version__ as lightning_version
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from ckpt import CheckpointManager, RandomWindowSampler, RNGState, SaveDecision, ShuffledSampler, layout
from ckpt import run as ckpt_run
from ckpt.distributed import topology
from ckpt.observer import check_observer
from ckpt.options import RETENTION_KEYWORDS, typed
from ckpt.safetensors_file import Entry, Writer, open_tensors, read_header
from ckpt.state import encodable
from ckpt.storage import open_storage
from ettr import GoodputTracker

from ._common import (
    TrackerLease,
    batch_hash,
    check_decision,
    check_flag,
    check_rng,
    check_samplers,
    delete_step,
    never_committed,
    read_step,
    refuse_rollback,
    resolve_step,
    save_once,
)

POINTER_FORMAT = "ckpt-lightning-pointer/1"
POINTERS = "lightning_pointers"  # metadata: the folder whose pointer files name a step, relative to the root
WRITTEN_AT = "lightning_root"  # metadata: where the root was when the step was written, to rebase its paths
# Under the root: a file per folder that pointers to the root's steps were written in (its path relative to the root),
# registered before its first pointer, so a step is deleted only when no pointer in any of them names it
FOLDERS = "lightning-folders"
FOLDER_FORMAT = "ckpt-lightning-folder/1"
_DROP = object()
_TMP = re.compile(r".+\.ckpt\.tmp-[0-9]+")  # a pointer being written (`_write_pointer`): NAME.ckpt.tmp-PID
# A pointer is renamed into place right after it is written (milliseconds; seconds on a slow object store): a
# temporary pointer file older than this has no live writer, whatever host wrote it (its PID says nothing here)
STALE_TMP_S = 120.0
# A pointer file modified less than this before it was read may change again unseen by its listing (timestamps of 1 to
# 2 s on some filesystems and object stores): it is read again at every listing until it is older (`_pointers`)
SETTLED_S = 2.0


def _abs_root(root: str | os.PathLike[str]) -> str:
    """A root that still means the same place from another working directory (URLs are kept as they are)."""
    root = os.fspath(root)
    return root if "://" in root else os.path.abspath(root)


def _real(path: str) -> str:
    """A local path with symlinks resolved, as Lightning spells its checkpoint folders (URLs as they are)."""
    return path.rstrip("/") if "://" in path else os.path.realpath(path)


def _relative(target: str, base: str) -> str:
    """`target` relative to the folder `base`, so both can move together; as it is when they differ in protocol."""
    if "://" not in target and "://" not in base:
        return os.path.relpath(_real(target), _real(base))
    (tp, tpath), (bp, bpath) = (x.split("://", 1) if "://" in x else ("file", x) for x in (target, base))
    return posixpath.relpath(tpath, bpath) if tp == bp else target


def _resolve(path: str, base: str) -> str:
    """A path stored by `_relative` against the folder `base`; absolute paths and URLs (old pointers) pass."""
    if "://" in path or os.path.isabs(path):
        return path
    if "://" in base:
        protocol, rest = base.split("://", 1)
        return f"{protocol}://{posixpath.normpath(posixpath.join(rest, path))}"
    return os.path.normpath(os.path.join(base, path))


_TENSOR = "tensor"  # a pointer's callback field holding a 0-dim tensor (a score): {"tensor": value, "dtype": name}


def _field(value: Any) -> Any:
    """A callback state value as a pointer stores it (JSON: scalars, 0-dim tensors as {"tensor", "dtype"}, dicts of
    those, e.g. ModelCheckpoint's ``best_k_models``), or `_DROP` if it is something else (kept as the step has it)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return {_TENSOR: value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping) and all(isinstance(k, str) and not isinstance(v, Mapping) for k, v in value.items()):
        items = {k: _field(v) for k, v in value.items()}
        return _DROP if any(v is _DROP for v in items.values()) else items
    return _DROP


def _value(field: Any) -> Any:
    """A pointer's callback field as the callback's state holds it (`_field` undone; old pointers hold str/None)."""
    if isinstance(field, dict):
        dtype = getattr(torch, field["dtype"], None) if isinstance(field.get("dtype"), str) else None
        if set(field) == {_TENSOR, "dtype"} and isinstance(dtype, torch.dtype):  # a name of torch's, not any attribute
            return torch.tensor(field[_TENSOR], dtype=dtype)
        return {k: _value(v) for k, v in field.items()}
    return field


def _path_fields(callbacks: Any) -> dict[str, dict[str, Any]]:
    """The entries of each callback state a pointer can hold (`_field`: ModelCheckpoint's paths, scores and
    ``best_k_models``, EarlyStopping's counters), as saved for one pointer."""
    if not isinstance(callbacks, Mapping):
        return {}
    fields = {}
    for key, state in callbacks.items():
        if isinstance(state, Mapping):
            encoded = {f: _field(v) for f, v in state.items() if isinstance(f, str)}
            fields[key] = {f: v for f, v in encoded.items() if v is not _DROP}
    return fields


def _rebase(tree: Any, old: str, new: str) -> Any:
    """`tree` with every string (value or key) at or below the folder `old` moved below `new`."""

    def move(x: Any) -> Any:
        return new + x[len(old) :] if isinstance(x, str) and (x == old or x.startswith(old + "/")) else x

    if isinstance(tree, dict):
        return {move(k): _rebase(v, old, new) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebase(v, old, new) for v in tree)
    return move(tree)


def saveable(tree: Any, key: str = "") -> tuple[Any, list[str]]:
    """The checkpoint dict without values the library cannot store without pickle; returns (clean, dropped keys).

    Leaves the library stores exactly (`ckpt.state.encodable`: tensors, numpy arrays and scalars, JSON scalars,
    bytes, torch dtypes and sizes), lists/tuples and dicts with str/int keys are kept; path-like values become str;
    any other object (e.g. an arbitrary hyper-parameter) is dropped with its dict entry.
    """
    dropped: list[str] = []

    def walk(x: Any, k: str) -> Any:
        if encodable(x):
            return x
        if isinstance(x, os.PathLike):
            return os.fspath(x)
        if isinstance(x, (list, tuple)):
            items = [walk(v, f"{k}.{i}") for i, v in enumerate(x)]
            if any(v is _DROP for v in items):
                return _DROP
            return tuple(items) if isinstance(x, tuple) else items
        if isinstance(x, Mapping):
            out = {}
            for name, v in x.items():
                sub = f"{k}.{name}" if k else str(name)
                value = walk(v, sub) if isinstance(name, (str, int)) and not isinstance(name, bool) else _DROP
                if value is _DROP:
                    dropped.append(sub)
                else:
                    out[name] = value
            return out
        return _DROP

    return walk(tree, key), dropped


class NothingToLoad(dict):
    """What `CkptCheckpointIO.load_checkpoint` returns when a fit starts fresh: a dict that is false, as Lightning's
    own "no checkpoint loaded" is (its connector restores nothing from a false checkpoint), with the version entry
    Lightning's checkpoint migration reads before that."""

    def __init__(self) -> None:
        super().__init__({"pytorch-lightning_version": lightning_version})

    def __bool__(self) -> bool:
        return False


def _folder(path: str) -> str:
    """The absolute, symlink-free folder of a pointer path (URLs keep their protocol)."""
    return os.path.dirname(path) if "://" in path else _real(os.path.dirname(os.path.abspath(path)))


def _modified(path: str) -> float:
    """When the file at `path` was last written (0 where the filesystem cannot tell), as Lightning picks "last"."""
    fs, p = fsspec.core.url_to_fs(path)
    try:
        return fs.modified(p).timestamp()
    except (NotImplementedError, FileNotFoundError):
        return 0.0


def _write_pointer(path: str, root: str, step: int, callbacks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write the small JSON file Lightning sees as the checkpoint (atomically where the filesystem allows); returns
    the pointer as `_read_pointer` reads it back.

    The root is stored relative to the pointer's folder, so a run directory can be moved or copied; `callbacks`
    are the path entries in which this pointer's checkpoint dict differs from the one stored for the step.
    """
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(posixpath.dirname(p), exist_ok=True)
    pointer = {"format": POINTER_FORMAT, "root": _relative(root, _folder(path)), "step": step}
    pointer.update({"callbacks": callbacks} if callbacks else {})
    tmp = f"{p}.tmp-{os.getpid()}"
    fs.pipe_file(tmp, json.dumps(pointer).encode())
    fs.mv(tmp, p)
    return {**pointer, "root": root}


def _member(folder: str, name: str) -> str:
    """The path of the file `name` in `folder` (spelled as `_folder` spells it)."""
    return posixpath.join(folder, name) if "://" in folder else os.path.join(folder, name)


def _signature(info: dict[str, Any]) -> str | None:
    """What a folder listing says of a file (size, times, inode, ETag... as the filesystem gives them), to tell that
    it changed since it was read; None where that cannot tell: a link (its target may change under it) or a listing
    with no more than the file's name, size and type."""
    if info.get("islink") or set(info) <= {"name", "size", "type"}:
        return None
    return json.dumps({k: v for k, v in info.items() if k != "name"}, sort_keys=True, default=str)


def _folder_entry(relative: str) -> str:
    """The registry file (below the root) of a pointer folder, by its path relative to the root."""
    return f"{FOLDERS}/{hashlib.sha256(relative.encode()).hexdigest()[:32]}.json"


def _registered(data: bytes | None, path: str) -> str | None:
    """The folder (relative to the root) a registry file at `path` records, or None if it is not one."""
    try:
        entry = json.loads(data or b"")
    except (UnicodeDecodeError, ValueError):
        return None
    folder = entry.get("folder") if isinstance(entry, dict) and entry.get("format") == FOLDER_FORMAT else None
    return folder if isinstance(folder, str) and _folder_entry(folder) == path else None


def _read_pointer(path: str) -> dict[str, Any] | None:
    """The pointer at `path` with its root made absolute, or None if the file is something else (a torch.save)."""
    fs, p = fsspec.core.url_to_fs(path)
    data = fs.cat_file(p)
    try:
        pointer = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(pointer, dict) and pointer.get("format") == POINTER_FORMAT):
        return None
    step, root = pointer.get("step"), pointer.get("root")
    if type(step) is not int or not 0 <= step < layout.STEP_LIMIT or not isinstance(root, str):
        raise ValueError(
            f"{path} is a damaged {POINTER_FORMAT} pointer: 'step' must be a step number and 'root' a path, got "
            f"{str(step)[:40]!r} and {str(root)[:200]!r}"
        )
    return {**pointer, "root": _resolve(root, _folder(path))}


WEIGHTS_MARK = "ckpt.lightning.weights"  # the safetensors metadata of a launcher's weights handoff (`_save_weights`)


def _save_weights(state: Mapping[str, Any], path: str) -> None:
    """Lightning's ddp_spawn launcher hands rank 0's trained weights to the main process through `save_checkpoint`,
    `load_checkpoint` and `remove_checkpoint` of a plain state dict (no ``global_step``) at a file of its own: that
    is no step of the root, so it is written there as a safetensors file (no pickle), whole or not at all."""
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"CkptCheckpointIO.save_checkpoint({path!r}): a dict without 'global_step' (a launcher's weights) holds "
            f"tensors only; {bad[:5]} are not"
        )
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    writer = Writer(tmp, [Entry(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], {WEIGHTS_MARK: "1"})
    try:
        for t in tensors.values():
            writer.write(t.reshape(-1).view(torch.uint8).numpy())
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.abandon()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _is_weights(path: str) -> bool:
    """Whether `path` is a local weights handoff `_save_weights` wrote (`read_header` refuses a pointer, which is JSON:
    its first 8 bytes read as a header length past the file's end)."""
    try:
        return WEIGHTS_MARK in read_header(path)[1]
    except (OSError, ValueError):
        return False


class CkptCheckpointIO(CheckpointIO):
    """Lightning `CheckpointIO` that saves through one `CheckpointManager` root, asynchronously and without pickle.

    ``save_checkpoint(ckpt, "dir/epoch=0-step=10.ckpt")`` starts an async save of step ``ckpt["global_step"]`` and
    writes that path as a JSON pointer to it; ``load_checkpoint`` follows the pointer (falling back to the newest
    committed step before it if the process died while writing it; a fit with `GoodputCallback` starts fresh, with a
    warning, if no step of the root is committed); ``remove_checkpoint`` deletes the pointer and, once no other
    pointer names the step (in any folder the root's pointers were written in) and a newer step is committed, the
    step itself;
    ``teardown()`` drains the writes. A `GoodputCallback` in the same Trainer reports saves and restores to its tracker.
    Values that cannot be stored without pickle (arbitrary hyper-parameters) are dropped with a warning.
    Every tensor is copied before ``save_checkpoint`` returns: the manager's default (``snapshot="sync"``), and
    Lightning hands a `CheckpointIO` state dicts, not optimizers, so ``snapshot="overlap"`` would defer nothing.
    Pointers and step metadata hold paths relative to the root, and callback paths under the root are rebased on
    load, so a run directory (root and pointer folders inside it) can be moved or copied and resumed there.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, tracker: GoodputTracker | None = None, **manager_options: Any
    ) -> None:
        self.root = _abs_root(root)
        self.tracker = check_observer(tracker)
        self._options = typed(manager_options)  # checked now, where the trainer is configured
        retention = sorted(RETENTION_KEYWORDS & set(manager_options))
        if retention:
            raise ValueError(
                f"CkptCheckpointIO options {retention}: the root's steps follow ModelCheckpoint's pointers (a step is "
                f"deleted once no pointer names it), and a retention of the manager's own deleted steps that pointers "
                f"still name (save_top_k's best, whose ckpt_path='best' load then failed); set save_top_k on the "
                f"ModelCheckpoint instead"
            )
        open_storage(self.root, self._options["root_options"].storage_options).check_creatable()  # and the root
        self._manager: CheckpointManager | None = None
        self._run: ckpt_run.Run | None = None  # this process's run (a generated id is kept when the manager reopens)
        self._done: set[int] = set()  # steps saved or restored by this process: a repeated request is a no-op
        # the last step saved or loaded: its dict's paths, and its top-level keys
        self._stored: tuple[int, dict[str, dict[str, Any]], frozenset[str]] | None = None
        self._orphans: set[int] = set()  # steps whose pointer was removed, not deletable yet
        self._adopted: set[str] = set()
        # per pointer folder, the ``last*.ckpt`` files `_adopt` found naming a step that is not committed, kept until
        # this process writes a ``last*.ckpt`` there (`_replace_stale`): until then they are what ckpt_path="last" finds
        self._stale_last: dict[str, set[str]] = {}
        self._folders: set[str] | None = None  # every folder pointers to the root's steps were written in (loaded once)
        self._damaged: str | None = None  # an unreadable record of a pointer folder: delete nothing
        # each pointer folder's files as this process last listed them, or wrote or removed them since (`_pointers`):
        # file name -> (its listing's `_signature` when it was read, None: read it again at the next listing; the
        # pointer read, None: no pointer to a step of this root)
        self._seen: dict[str, dict[str, tuple[str | None, dict[str, Any] | None]]] = {}
        # pointer folders a save swept clean (`_sweep`): this process's own temporary pointer files are renamed at
        # once, and it holds the root's lease, so its saves there look for none again (a glob of the whole folder)
        self._swept: set[str] = set()
        # GoodputCallback, between a fit's setup and its start: a resume starts the tracker first. Only a fit's load
        # may find nothing to resume and start fresh (validate/test/predict must not run on untrained weights)
        self.before_load: Callable[[], None] | None = None
        self._fresh: str | None = None  # the pointer folder of a fit starting fresh, cleaned by start_fit
        self.loaded: int | None = None  # the step the fit under way loaded (None: none; GoodputCallback resets it)

    @property
    def manager(self) -> CheckpointManager:
        """The manager of `root`, opened on first use (again after `teardown`).

        It checkpoints `alone` on every rank: Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on rank 0
        only (DDP's state is replicated), so rank 0 writes the whole state by itself, holds the root's lease and
        deletes; every rank reads the whole state when it loads. A collective manager would wait at rank 0's first
        save for ranks that never come (`ckpt.CollectiveTimeout` after ``collective_timeout``)."""
        if self._manager is None:
            world = topology()[1]
            if world > 1 and self._options["tiers"] is not None:
                raise ValueError(
                    f"CkptCheckpointIO(local=...) runs in one process only, not among {world} ranks: Lightning saves "
                    f"on rank 0 alone, so the other ranks could not read the steps its local tier holds; leave out "
                    f"local= (every rank loads from {self.root})"
                )
            manager = CheckpointManager(self.root, alone=True, **self._options)
            if self._run is not None:  # reopened after a teardown (a second fit of the trainer): the same run
                manager.run = self._run
            self._run = manager.run
            manager.tracker = self.tracker  # told the run's id
            self._manager = manager
        return self._manager

    def use_tracker(self, tracker: GoodputTracker | None) -> None:
        """Report saves and restores to `tracker` from now on (None: to nobody)."""
        self.tracker = tracker
        if self._manager is not None:
            self._manager.tracker = tracker

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Start an async save of the checkpoint's global step and point `path` at it."""
        if storage_options is not None:
            raise TypeError("CkptCheckpointIO takes no storage_options; configure the manager through its constructor")
        if "global_step" not in checkpoint:  # ddp_spawn's launcher handing the weights to the main process
            return _save_weights(checkpoint, os.fspath(path))
        step = int(checkpoint["global_step"])
        if not self._done:  # this process's first save or load: a step older than the root's newest goes back
            newest = self.manager.latest_step()
            if newest is not None and step < newest:
                raise ValueError(
                    f"CkptCheckpointIO: saving step {step} into {self.root}, whose newest committed step is {newest}: "
                    f"a resume would then go back to it. Under strategy='ddp_spawn' a trainer.save_checkpoint after "
                    f"fit runs in the main process, whose trainer is at step 0: save from inside the fit (a callback) "
                    f"or use strategy='ddp'. To train on from an older step, roll back first: python -m ckpt rollback "
                    f"{self.root} --to N"
                )
        clean, dropped = saveable(checkpoint)
        if dropped:
            warnings.warn(
                f"checkpoint entries {dropped} cannot be saved without pickle and were dropped "
                f"(hyper-parameters of arbitrary types are not restored)",
                UserWarning,
                stacklevel=2,
            )
        folder = _folder(os.fspath(path))
        self._adopt(folder, _last_paths(clean.get("callbacks")))
        metadata = {POINTERS: _relative(folder, self.root), WRITTEN_AT: _real(self.root)}
        fields = _path_fields(clean.get("callbacks"))
        if self._stored is not None and self._stored[0] == step and step in self._done:
            missing = sorted(set(clean) - self._stored[2])
            if missing:
                raise ValueError(
                    f"CkptCheckpointIO: step {step} was saved without {missing} (an earlier save of the same step, "
                    f"e.g. by a ModelCheckpoint(save_weights_only=True), came first) and a step is saved once, so "
                    f"{os.fspath(path)} would name a checkpoint a resume cannot train on from. Put the ModelCheckpoint "
                    f"that saves the whole state before the weights-only one in callbacks=[...] (Lightning keeps their "
                    f"order), or let them save at different steps"
                )
        if save_once(self.manager, step, clean, skip=tuple(self._done), metadata=metadata):
            self._done.add(step)
            self._stored = step, fields, frozenset(clean)
        stored = self._stored[1] if self._stored is not None and self._stored[0] == step else {}
        self._forget(os.fspath(path))  # an overwritten pointer (e.g. last.ckpt) no longer names its old step
        self._saw(os.fspath(path), _write_pointer(os.fspath(path), self.root, step, _changed(stored, fields)))
        if _is_last(os.fspath(path)):
            self._replace_stale(folder, os.path.basename(os.fspath(path)))
        if folder not in self._swept and self._sweep(folder):
            self._swept.add(folder)
        self._collect()

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict `path` was saved with; tensors are on CPU (Lightning moves them when loading).

        That is the step's stored dict with the pointer's own callback entries (e.g. ModelCheckpoint's
        ``last_model_path`` of ``last.ckpt``; after a fallback, those of the newest pointer naming the step loaded)
        and, for a moved root, every callback path under it rebased.

        If the pointer's step never committed and no step of the root is (the process died before its first save
        committed), a fit with `GoodputCallback` starts fresh: a warning and `NothingToLoad`, from which Lightning
        restores nothing, as when it finds no checkpoint; its start-up check follows in `on_fit_start`. Any other
        load (validate, test, predict; a fit without `GoodputCallback`, whose stage this IO cannot know) raises
        FileNotFoundError.
        """
        if _is_weights(os.fspath(path)):  # ddp_spawn's launcher: rank 0's weights, for the main process
            return {k: t.clone() for k, t in open_tensors(os.fspath(path))[0].items()}
        self._fresh = None
        pointer = self._pointer(os.fspath(path))
        step = resolve_step(self.manager, int(pointer["step"]))
        if step is None:
            return self._nothing_to_load(os.fspath(path), int(pointer["step"]))
        if self.before_load is not None:  # a fit: it trains on from `step`
            refuse_rollback(self.manager, step, self._naming)
            self.before_load()
        if _writer():
            self._sweep(_folder(os.fspath(path)))
        metadata = self.manager.metadata(step)  # once: for the keys and where it was written
        checkpoint = read_step(self.manager, step, metadata=metadata)
        callbacks = checkpoint.get("callbacks")
        self._stored = step, _path_fields(callbacks), frozenset(checkpoint)
        if step != pointer["step"]:  # a fallback: the callbacks as the newest pointer naming `step` recorded them
            named = [(_modified(p), p, q) for p, q in self._pointers(_folder(os.fspath(path))) if q["step"] == step]
            pointer = max(named, key=lambda n: n[:2])[2] if named else {}
        if isinstance(callbacks, dict):
            for key, fields in pointer.get("callbacks", {}).items():
                if isinstance(callbacks.get(key), dict):
                    callbacks[key].update({f: _value(v) for f, v in fields.items()})
        written_at = metadata.get(WRITTEN_AT)
        if isinstance(callbacks, dict) and written_at is not None and written_at != _real(self.root):
            checkpoint["callbacks"] = _rebase(callbacks, written_at, _real(self.root))
        self._done.add(step)
        self.loaded = step
        return checkpoint

    @property
    def starting_fresh(self) -> bool:
        """Whether the last load found nothing to resume (`NothingToLoad`) and the fit's `start_fit` is yet to come."""
        return self._fresh is not None

    def _nothing_to_load(self, path: str, step: int) -> NothingToLoad:
        """A fit's load finds no committed step in the root: a fresh start (the check and the clean-up of the
        folder's pointers to steps that never committed follow in `start_fit`). Not a fit's: FileNotFoundError."""
        what = never_committed(self.manager, step, path)
        if self.before_load is None:
            raise FileNotFoundError(
                f"{what}: there is no checkpoint to load. A fit(ckpt_path=...) with GoodputCallback starts fresh "
                f"here; without it, delete the pointers naming steps that never committed (or fit without ckpt_path)"
            )
        warnings.warn(f"{what}: nothing to resume, the fit starts fresh", RuntimeWarning, stacklevel=3)
        self._fresh = _folder(path)
        return NothingToLoad()

    def start_fit(self, resume: bool, writer: bool | None = None) -> bool:
        """The start-up check of a fit, before anything is written (`ckpt.run.check_start`): True to resume the
        root's newest step. A fit that loaded no checkpoint into a root holding another run's committed steps raises
        `ckpt.RunMismatchError`; a resume claims the root for this run. Only the `writer` (the rank that saves:
        rank 0; default: torch.distributed's rank 0, or this process alone) writes anything: it claims the root and,
        once the start is allowed, clears the pointer folders of the root's steps of temporary pointer files left by
        a writer killed mid-write, and, after a load that found nothing to resume (`NothingToLoad`), its folder of
        pointers to steps that never committed (ModelCheckpoint would otherwise pick ``-v1`` names). The writer takes
        the root's lease first (a resume: before its claim; `ckpt.LeaseHeldError` while another process writes the
        root), so a second fit of a live root trains nothing. The other ranks only check (their generated run ids
        are their own)."""
        writer = _writer() if writer is None else writer
        if resume and writer:  # before its claim: a second fit of a live root fails here, not after training
            self.manager.hold_lease()
        if resume and not writer:
            same_run = bool(self.manager.steps())  # check_start's answer, without its claim
        else:
            same_run = ckpt_run.check_start(
                self.manager.storage,
                self.manager.run,
                resume=resume,
                how_to_resume=self._how_to_resume,  # read (every pointer) only for a refusal
                how_to_start_over=f"give CkptCheckpointIO a new root (or delete {self.root})",
            )
        fresh, self._fresh = self._fresh, None
        if not writer:
            return same_run
        self.manager.hold_lease()  # a start that loaded nothing: after the check, which writes nothing if it refuses
        for folder in self._pointer_folders():
            self._sweep(folder)
        if fresh is not None:
            self._sweep(fresh)
            self._adopt(fresh)
        return same_run

    def load_newest(self) -> dict[str, Any]:
        """The checkpoint dict of the newest committed step (a restart of this root's run started without ckpt_path),
        as ``fit(ckpt_path="last")`` loads it: through the newest ``last*.ckpt`` pointer naming the step, else another
        pointer naming it. Their callback entries (ModelCheckpoint's ``last_model_path``, its top-k) are not in the
        step: without them ModelCheckpoint wrote ``last-v1.ckpt`` beside ``last.ckpt``, which pinned its step."""
        step = self.manager.latest_step()
        named = self._named(step)
        if named:
            last = [p for p in named if _is_last(p)]
            return self.load_checkpoint(max(last, key=_modified) if last else min(named))
        checkpoint = read_step(self.manager, step)
        self._done.add(step)
        self.loaded = step
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the pointer, and its step once no other pointer in that folder names it and it is not the newest (a
        launcher's weights handoff: the file alone)."""
        if _is_weights(os.fspath(path)):
            os.remove(os.fspath(path))
            return
        fs, p = fsspec.core.url_to_fs(os.fspath(path))
        if fs.exists(p):
            self._adopt(_folder(os.fspath(path)))
            self._forget(os.fspath(path))
            self._remove_pointer(os.fspath(path))
            self._collect()

    def _adopt(self, folder: str, lasts: frozenset[str] = frozenset()) -> None:
        """Once per process and folder, before writing there: drop pointers to steps that are not committed (left
        by a process that died while saving; this process is the root's writer now), and make earlier attempts'
        steps of the folder candidates for deletion (their removals may have died). Such a ``last*.ckpt`` that is one
        of `lasts` (`_last_paths`: the trainer's ModelCheckpoint writes it next, over it) stays until then."""
        if folder in self._adopted:
            return
        self._register(folder)
        self._adopted.add(folder)
        committed = self.manager.steps()
        for path, pointer in self._pointers(folder):
            if pointer["step"] not in committed and pointer["step"] not in self._done:
                if _real(path) in lasts and committed and committed[0] < pointer["step"]:
                    # a resume from "last" falls back through it to the newest committed step before its step: removed
                    # now, a kill before the next last.ckpt is written would leave "last" nothing to find. (One that
                    # ModelCheckpoint does not write next goes now: left, it would make it pick last-v1.ckpt.)
                    self._stale_last.setdefault(folder, set()).add(os.path.basename(path))
                    continue
                warnings.warn(
                    f"removing {path}: it names step {pointer['step']} of {self.root}, which is not "
                    f"committed (its save died with its process, or the step was deleted)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._remove_pointer(path)
        for step in committed:
            saved = self.manager.metadata(step).get(POINTERS)
            if saved is not None and _real(_resolve(saved, _real(self.root))) == folder:
                self._orphans.add(step)

    def _replace_stale(self, folder: str, written: str) -> None:
        """This process just wrote the ``last*.ckpt`` pointer `written` in `folder`: the stale ``last*.ckpt`` files
        `_adopt` kept there are replaced now. One of the same name was replaced atomically by that write (its step
        became a candidate for deletion in `save_checkpoint`); any other (ModelCheckpoint picked ``last-v1.ckpt``
        beside it) is removed, its step a candidate for deletion too."""
        for name in sorted(self._stale_last.pop(folder, set()) - {written}):
            path = _member(folder, name)
            self._forget(path)
            self._remove_pointer(path)

    def _remove_pointer(self, path: str) -> None:
        """Remove the pointer file at `path` (one removed meanwhile, by another process, is gone all the same) and
        note it in this process's view of its folder (`_saw`)."""
        fs, p = fsspec.core.url_to_fs(path)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(p)
        self._saw(path, None)

    def _pointer_folders(self) -> set[str]:
        """Every folder pointers to this root's steps were written in, as `_folder` gives them: those registered under
        the root, and those the committed steps were saved with (their metadata: roots written before the registry)."""
        if self._folders is None:
            storage, base = self.manager.storage, _real(self.root)
            folders = set()
            for name in storage.list_files(FOLDERS):
                path = f"{FOLDERS}/{name}"
                relative = _registered(storage.read(path), path)
                if relative is None:
                    self._damaged = f"{self.root}/{path}"
                    warnings.warn(
                        f"{self._damaged} is a damaged {FOLDER_FORMAT} entry (the record of a folder of Lightning "
                        f"pointers to this root's steps): this process deletes no step, as one may be named by a "
                        f"pointer there; delete the entry to let removed checkpoints go again",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                else:
                    folders.add(_real(_resolve(relative, base)))
            for step in self.manager.steps():
                saved = self.manager.metadata(step).get(POINTERS)
                if saved is not None:
                    folders.add(_real(_resolve(saved, base)))
            self._folders = folders
        return self._folders

    def _register(self, folder: str) -> None:
        """Record `folder` under the root before the first pointer is written in it (`_pointer_folders`)."""
        if folder in self._pointer_folders():
            return
        relative = _relative(folder, self.root)
        data = json.dumps({"format": FOLDER_FORMAT, "folder": relative}).encode()
        self.manager.storage.write_atomic(_folder_entry(relative), data)
        self._pointer_folders().add(folder)

    def _sweep(self, folder: str) -> bool:
        """Remove the temporary pointer files (``NAME.ckpt.tmp-PID``) a process killed inside `_write_pointer` left:
        they name nothing Lightning reads and would otherwise stay forever. Only those older than `STALE_TMP_S`: a
        younger one may be a live writer's (another process loading from this folder must not break its rename).
        True if it left none that a later sweep could remove."""
        fs, p = fsspec.core.url_to_fs(folder)
        now = datetime.datetime.now(datetime.timezone.utc)
        done = True
        for name in fs.glob(f"{p.rstrip('/')}/*.ckpt.tmp-*"):
            if not _TMP.fullmatch(posixpath.basename(name)):
                continue
            try:
                if (now - fs.modified(name)).total_seconds() > STALE_TMP_S:
                    fs.rm(name)
                else:
                    done = False
            except FileNotFoundError:  # renamed or removed meanwhile
                pass
            except NotImplementedError:  # a filesystem that cannot tell a file's age: nothing is known stale
                return True
        return done

    def _pointers(self, folder: str) -> list[tuple[str, dict[str, Any]]]:
        """(path, pointer) of every pointer file in `folder` that names a step of this root, as the folder is listed
        now; a file is read only if it is new or its `_signature` changed since this process read it (or it was
        modified within `SETTLED_S` before that read). A name that is no file is none: a ``last.ckpt`` link of
        ``save_last="link"`` whose target top-k just removed (it is linked again right after), a file removed since
        the listing, a folder (DeepSpeed's checkpoints)."""
        fs, p = fsspec.core.url_to_fs(folder)
        seen, now = self._seen.get(folder, {}), {}
        for name, info in fs.glob(f"{p.rstrip('/')}/*.ckpt", detail=True).items():
            base, signature = posixpath.basename(name), _signature(info)
            if signature is not None and seen.get(base, (None, None))[0] == signature:
                now[base] = seen[base]
                continue
            path = _member(folder, base)
            settled = 0 < _modified(path) < time.time() - SETTLED_S  # taken before the read: a later change shows
            try:
                pointer = _read_pointer(path)
            except (FileNotFoundError, IsADirectoryError):
                continue
            now[base] = (signature if settled else None), pointer if pointer and self._ours(pointer) else None
        self._seen[folder] = now
        return [(_member(folder, base), pointer) for base, (_, pointer) in now.items() if pointer is not None]

    def _saw(self, path: str, pointer: dict[str, Any] | None) -> None:
        """This process wrote `pointer` at `path` (None: removed the file there): its view of the folder (`_collect`)
        has it so until the folder's next listing (`_pointers`), which reads it again."""
        seen = self._seen.setdefault(_folder(path), {})
        if pointer is None:
            seen.pop(os.path.basename(path), None)
        else:
            seen[os.path.basename(path)] = None, pointer

    def _ours(self, pointer: dict[str, Any]) -> bool:
        """Whether a pointer names a step of this root (wherever the root was when it was written)."""
        return _real(pointer["root"]) == _real(self.root)

    def _forget(self, path: str) -> None:
        """Remember the step an existing pointer at `path` names as a candidate for deletion."""
        fs, p = fsspec.core.url_to_fs(path)
        pointer = _read_pointer(path) if fs.exists(p) else None
        if pointer is not None and self._ours(pointer):
            self._orphans.add(int(pointer["step"]))

    def _collect(self, listed: bool = False) -> None:
        """Delete the candidate steps that no pointer names, in any pointer folder of the root (another
        ModelCheckpoint's may name the step one removed), and that a newer committed step covers. The folders are
        listed (`_pointers`) only where this process's view of them (as it last listed them, with its own writes and
        removals since) leaves a candidate unnamed, or if `listed`: a save that frees no step reads no pointer; a
        pointer another process removed frees its step at the next listing."""
        if not self._orphans:
            return
        folders = self._pointer_folders()
        if self._damaged:
            return
        seen = {pointer["step"] for folder in folders for _, pointer in self._seen.get(folder, {}).values() if pointer}
        if not listed and self._orphans <= seen:
            return
        named = {pointer["step"] for folder in folders for _, pointer in self._pointers(folder)}
        for step in sorted(self._orphans - named):
            if delete_step(self.manager, step):
                self._orphans.discard(step)

    def _named(self, step: int) -> list[str]:
        """The pointers (in every pointer folder of the root) that name `step`."""
        return [path for folder in self._pointer_folders() for path, p in self._pointers(folder) if p["step"] == step]

    def _naming(self, step: int) -> str:
        """How a fit resumes `step`: through a pointer that names it, if one does."""
        named = self._named(step)
        return f": fit(..., ckpt_path={min(named)!r})" if named else ""

    def _how_to_resume(self) -> str:
        """How a fit resumes the root's newest step: through a pointer that leads to it, one naming it or a step after
        it, which never committed (its load falls back to the newest step: a process killed while writing that step
        left it). ``ckpt_path="last"`` where every ``last*.ckpt`` pointer leads there (a process killed between its
        pointers can leave a folder without last.ckpt, and "last" then finds nothing), else such a pointer by its
        path; where none does (every pointer to it removed), the recorded run id that `check_start` names next."""
        step = self.manager.latest_step()
        pointers = [(p, q["step"]) for folder in self._pointer_folders() for p, q in self._pointers(folder)]
        leading = [p for p, s in pointers if step is None or s >= step]
        lasts = [p for p, _ in pointers if _is_last(p)]
        if step is None or (lasts and set(lasts) <= set(leading)):
            return 'trainer.fit(model, ..., ckpt_path="last")'
        if leading:
            return f"trainer.fit(model, ..., ckpt_path={min(leading)!r})"
        return f"no pointer file names step {step} any more: restart with the run id recorded there (see below)"

    def _pointer(self, path: str) -> dict[str, Any]:
        """The pointer file at `path`; clear errors for foreign files and other roots."""
        pointer = _read_pointer(path)
        if pointer is None:
            raise ValueError(
                f"{path} is not a checkpoint written by CkptCheckpointIO (no {POINTER_FORMAT} pointer); "
                f"load it with Lightning's default TorchCheckpointIO"
            )
        if not self._ours(pointer):
            raise ValueError(f"{path} points into {pointer['root']}, but this CkptCheckpointIO uses {self.root}")
        return pointer

    def wait(self) -> None:
        """Block until every started save is committed (raises a background write error)."""
        if self._manager is not None:
            self._manager.wait()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its manager (threads, an arena), which a copy opens on first use: ddp_spawn pickles the
        trainer, this plugin with it, for every launch, also after the main process saved or loaded through it."""
        return {**self.__dict__, "_manager": None}

    def teardown(self) -> None:
        """Drain the writes and release the manager (reopened on next use)."""
        if self._manager is not None:
            self._manager.wait()
            self._collect(listed=True)
            manager, self._manager = self._manager, None
            manager.close()


def _same_start(trainer: Trainer, io: CkptCheckpointIO) -> None:
    """Every rank of a fit starts from the same step, or every rank raises: a rank that cannot see the root's steps or
    pointers (a node-local root or pointer folder) would start fresh while rank 0 resumes, the ranks' models and
    optimizers would differ, and the job would hang at its first collective. One all-gather, at the fit's start."""
    mine = torch.tensor([-1 if io.loaded is None else io.loaded], device=trainer.strategy.root_device)
    steps = [int(s) for s in trainer.strategy.all_gather(mine).reshape(-1).tolist()]
    if len(set(steps)) > 1:
        said = ", ".join(f"rank {r} {'nothing' if s < 0 else f'step {s}'}" for r, s in enumerate(steps))
        raise RuntimeError(
            f"the ranks of this fit start from different steps of {io.root} ({said}): every rank must reach the root "
            f"and ModelCheckpoint's folder (a shared file system or an object store)"
        )


def _same_samplers(trainer: Trainer, samplers: Mapping[str, Sampler], when: str) -> None:
    """Every rank's samplers hold one state (seed, batch size, data, position, skips), or every rank raises: Lightning
    writes rank 0's checkpoint alone, so a rank whose sampler differs trained on other batches than it, and a resume
    would put it on rank 0's state unseen (the check a `CheckpointManager` save among ranks makes for samplers,
    `same_on_every_rank`). One all-gather of a digest; on a difference, rank 0's states are broadcast to name it."""
    states = {name: s.state_dict() for name, s in samplers.items() if getattr(s, "same_on_every_rank", False)}
    digest = hashlib.sha256(json.dumps(states, sort_keys=True).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], device=trainer.strategy.root_device)
    digests = [int(d) for d in trainer.strategy.all_gather(mine).reshape(-1).tolist()]
    if len(set(digests)) == 1:
        return
    first = trainer.strategy.broadcast(states, src=0)
    others = [rank for rank, d in enumerate(digests) if d != digests[0]]
    diffs = []
    for name in sorted(set(first) | set(states)):
        theirs, ours = first.get(name, {}), states.get(name, {})
        diffs += [
            f"{name!r} {key}: rank 0 has {str(theirs.get(key))[:80]}, rank {trainer.global_rank} has "
            f"{str(ours.get(key))[:80]}"
            for key in sorted(set(theirs) | set(ours))
            if theirs.get(key) != ours.get(key)
        ]
    raise RuntimeError(
        f"the samplers of rank(s) {others} differ from rank 0's at {when}"
        + (f" ({'; '.join(diffs)})" if diffs else "")
        + ": Lightning saves rank 0's state alone, so those ranks trained on other batches and a resume would put "
        "them on rank 0's. Build every rank's sampler with the same seed, global_batch_size and data, and skip the "
        "same items on every rank"
    )


def _is_last(path: str) -> bool:
    """Whether `path` is one of ModelCheckpoint's ``last*.ckpt`` pointers (``last.ckpt``, ``last-v1.ckpt``)."""
    return posixpath.basename(path).startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)


def _last_paths(callbacks: Any) -> frozenset[str]:
    """The ``last*.ckpt`` paths the callbacks of a checkpoint dict write next (ModelCheckpoint's ``last_model_path``:
    it overwrites that file rather than picking ``last-v1.ckpt`` beside it), symlinks resolved."""
    if not isinstance(callbacks, Mapping):
        return frozenset()
    paths = (state.get("last_model_path") for state in callbacks.values() if isinstance(state, Mapping))
    return frozenset(_real(p) for p in paths if isinstance(p, str) and p)


def _writer() -> bool:
    """Whether this process is the one Lightning saves from: torch.distributed's rank 0, or a process alone."""
    return topology()[0] == 0


def _changed(stored: dict[str, dict[str, Any]], fields: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The callback entries of `fields` that differ from the step's `stored` ones (empty callbacks dropped)."""
    diff = {
        key: {f: v for f, v in entries.items() if stored.get(key, {}).get(f, _DROP) != v}
        for key, entries in fields.items()
    }
    return {key: entries for key, entries in diff.items() if entries}


Sampler = ShuffledSampler | RandomWindowSampler


class GoodputCallback(Callback):
    """Times batches as goodput steps, marks exceptions as disruptions, and saves RNG and sampler positions.

    Args:
        root: goodput ledger root; default: the root of the Trainer's `CkptCheckpointIO`.
        tracker: a started GoodputTracker managed by the caller, instead of one this callback starts and ends.
        samplers: `ckpt` samplers (`ShuffledSampler`, `RandomWindowSampler`) feeding the training DataLoaders
            (batch_sampler=), advanced by one batch after each training batch; their positions are saved here and
            restored before the loaders iterate.
        rng: an `RNGState` (with registered generators), True for every global RNG, False for none. It is
            restored lazily at the first training batch after a resume, so no draw in Lightning's setup shifts it;
            a validation inside the fit hands it back as it found it (a resume does not re-run the validation).
        record_loss: put each batch's loss (``training_step``'s, as Lightning hands it to ``on_train_batch_end``) and
            the samplers' batch hash into its goodput record, where a step trained again after a resume is compared
            with its first pass (docs/goodput.md, replay verification). Reading a loss on a GPU waits for the
            step's kernels (``.item()``); False records the batch hash only.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        tracker: GoodputTracker | None = None,
        samplers: Mapping[str, Sampler] | None = None,
        rng: RNGState | bool = True,
        record_loss: bool = True,
    ) -> None:
        self._lease = TrackerLease(_abs_root(root) if root is not None else None, tracker)
        self.record_loss = check_flag("record_loss", record_loss)
        self.samplers = check_samplers(samplers)
        self.rng = RNGState() if check_rng(rng) is True else (rng or None)
        self._pending_rng: dict[str, Any] | None = None
        self._training_rng: dict[str, Any] | None = None  # the RNG state a validation from here gives back
        self._attempts: list[str] = []
        self._open: int | None = None  # the goodput step open since its first micro-batch, and what they recorded
        self._losses: list[Any] = []
        self._batches: list[str | None] = []
        self._begun = False
        self._rank: int | None = None  # the trainer's global rank among several (Lightning's launcher sets no RANK)

    @property
    def tracker(self) -> GoodputTracker | None:
        """The tracker of the current fit (None before the first one)."""
        return self._lease.tracker

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse strategies that bypass CheckpointIO, and ranks whose samplers differ before a resume loads rank 0's
        state into them (`_same_samplers`); start the tracker, or, with a `CkptCheckpointIO`, let a resume start it
        before its load (a fit that loads nothing is checked first, in `on_fit_start`)."""
        if stage != "fit":
            return
        if trainer.world_size > 1:
            _same_samplers(trainer, self.samplers, "the fit's start")
        io = _ckpt_io(trainer)
        self._begun = False
        self._rank = trainer.global_rank if trainer.world_size > 1 else None
        if io is None:
            self._begin(None, resume=False)
            return
        _check_strategy(trainer)
        io.loaded = None
        io.before_load = lambda: self._begin(io, resume=True)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A fit that loaded no checkpoint (also one whose ``ckpt_path`` named a step that never committed in a root
        without committed steps: `NothingToLoad`): refused before anything is written if the root holds another run's
        steps (`ckpt.RunMismatchError`); a restart of the root's own run (same run id) resumes its newest step
        silently. Among several processes every rank must start from the same step (`_same_start`)."""
        io = _ckpt_io(trainer)
        if io is None:
            return
        if not self._begun:
            fresh = io.starting_fresh
            same_run = io.start_fit(resume=False, writer=trainer.is_global_zero)
            self._begin(io, resume=False)
            if fresh and not same_run:
                trainer.ckpt_path = None  # nothing was loaded from it (Lightning's public setter; None: no checkpoint)
            if same_run:  # Lightning's own path for strategies that restore after setup; the rest follows in fit
                connector = trainer._checkpoint_connector
                connector._loaded_checkpoint = io.load_newest()
                connector.restore_model()
                connector.restore_datamodule()
                connector.restore_callbacks()
        if trainer.world_size > 1:
            _same_start(trainer, io)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Among several processes, refuse a save whose ranks' samplers differ (`_same_samplers`): every rank builds
        the checkpoint, and rank 0's alone is written."""
        if trainer.world_size > 1:
            _same_samplers(trainer, self.samplers, f"the save of step {trainer.global_step}")

    def _begin(self, io: CkptCheckpointIO | None, resume: bool) -> None:
        """Start this fit's tracker (once) and attach it to the IO; a resume first claims the root for this run."""
        if self._begun:
            return
        self._begun = True
        if io is not None:
            io.before_load = None
            if resume:
                io.start_fit(resume=True)
        if io is None:
            tracker = self._lease.start(rank=self._rank)
        else:  # the ledger beside the checkpoints, reached as they are (an object store's endpoint)
            tracker = self._lease.start(io.root, self._rank, io._options["root_options"].storage_options)
        if io is not None:
            io.use_tracker(tracker)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Apply a restored RNG state (once), then open the goodput step that this batch's optimizer step completes."""
        if self._pending_rng is not None:
            state, self._pending_rng = self._pending_rng, None
            self._load_rng(state)
        if self._open is None:  # the step's first micro-batch (accumulate_grad_batches: the others join it)
            self._open, self._losses, self._batches = trainer.global_step + 1, [], []
            self.tracker.step_begin(self._open)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch as consumed by every sampler (before ModelCheckpoint saves); once the optimizer stepped,
        close the step with its micro-batches' losses summed and their batch hashes joined by ``+``: one record per
        optimizer step, as the checkpoints count them. Snapshot the RNG that a validation from here gives back."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self.record_loss and (hasattr(loss, "item") or isinstance(loss, float)):  # not asked for, or not a
            self._losses.append(loss.detach() if hasattr(loss, "detach") else loss)  # number (manual optimization)
        self._batches.append(batch_hash(self.samplers))
        for sampler in self.samplers.values():
            sampler.advance()
        if trainer.global_step >= self._open:
            self._close()
        if self.rng is not None and trainer.enable_validation:  # a validation may follow, drawing before its first
            self._training_rng = self.rng.state_dict()  # hook (a DataLoader without a generator draws a base seed)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A validation after a training batch gives the RNG back as training left it (before ModelCheckpoint saves
        here): a resume from a save before the validation does not re-run it, so training must not depend on it."""
        if self._training_rng is not None:
            state, self._training_rng = self._training_rng, None
            self.rng.load_state_dict(state)

    def _close(self) -> None:
        """End the open goodput step with what its micro-batches recorded (a loss only if each gave one)."""
        losses, batches, step = self._losses, self._batches, self._open
        self._open = None
        loss = sum(losses[1:], losses[0]) if losses and len(losses) == len(batches) else None
        batch = "+".join(batches) if all(b is not None for b in batches) else None
        self.tracker.step_end(step, loss, batch=batch)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Drain what can be drained and end the attempt as a failure. The IO is torn down here, while its deletions
        are still recorded in this attempt's ledger: Lightning tears it down only after this hook."""
        io = _ckpt_io(trainer)
        try:
            if io is not None:
                io.teardown()
        except Exception as e:  # noqa: BLE001 - the training exception is the one Lightning re-raises
            warnings.warn(f"checkpoint write failed while handling {type(exception).__name__}: {e}", RuntimeWarning)
        finally:
            self._release(io, "error")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """After a successful fit: wait for the last saves to commit, then end the attempt."""
        if stage != "fit":
            return
        if self._open is not None:  # micro-batches after the last optimizer step (manual optimization): trained time
            self._close()
        io = _ckpt_io(trainer)
        try:
            if io is not None:
                io.wait()
        finally:
            self._release(io, "ok")

    def _release(self, io: CkptCheckpointIO | None, status: str) -> None:
        """End the attempt's tracker; the IO stops reporting to it (a later test/validate load is not timed), and a
        later validation leaves the RNG alone."""
        if io is not None:
            io.use_tracker(None)
            io.before_load = None
        self._open = self._training_rng = None
        self._lease.end(status)

    def state_dict(self) -> dict[str, Any]:
        """RNG state, sampler positions and the goodput attempts that produced this training state."""
        tracker = self.tracker
        attempts = self._attempts + ([tracker.attempt_id] if tracker is not None and tracker.attempt_id else [])
        rng = self.rng.state_dict() if self.rng is not None else None
        if self._training_rng is not None:  # a validation after this save gives back the RNG a resume starts from
            self._training_rng = rng  # (a callback between the batch-end snapshot and the save may have drawn)
        return {
            "rng": rng,
            "samplers": {name: s.state_dict() for name, s in self.samplers.items()},
            "attempts": attempts,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Position the samplers now (before the loaders iterate); keep the RNG state for the first batch."""
        missing = sorted(set(self.samplers) - set(state_dict["samplers"]))
        if missing:
            raise KeyError(f"checkpoint has no state for samplers {missing}; saved: {sorted(state_dict['samplers'])}")
        for name, sampler in self.samplers.items():
            sampler.load_state_dict(state_dict["samplers"][name])
        self._pending_rng = state_dict["rng"] if self.rng is not None else None
        self._attempts = list(state_dict["attempts"])

    def _load_rng(self, state: dict[str, Any]) -> None:
        """Restore the RNGs; another rank's or topology's state is skipped with a warning (streams are per rank)."""
        try:
            self.rng.load_state_dict(state)
        except ValueError as e:
            warnings.warn(f"RNG state not restored: {e}", RuntimeWarning)


class DecisionCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that also saves after a training batch when a `ckpt.SaveDecision` says so (every T
    seconds, the advised interval, a preemption signal); its own triggers, file names, top-k and ``last.ckpt`` work
    as usual (pass ``every_n_epochs=0`` to leave saving to the decision alone).

    Every save it makes restarts the decision's intervals; so does the start of a fit (or the restored step). Among
    several processes the ranks agree at each batch (one all-reduce): every rank saves when any rank's decision says
    so (a time or a signal seen by one rank), so every rank saves the same steps.
    """

    def __init__(
        self, decision: SaveDecision, *, clock: Callable[[], float] = time.monotonic, **model_checkpoint: Any
    ) -> None:
        super().__init__(**model_checkpoint)
        self.decision, self.clock = check_decision(decision), clock

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.decision.saved(trainer.global_step, self.clock())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """ModelCheckpoint's own triggers first; then, unless it just saved this step, the decision's."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._should_skip_saving_checkpoint(trainer):
            return
        due = self.decision.should_save(trainer.global_step, self.clock())
        if trainer.strategy.reduce_boolean_decision(due, all=False):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self.decision.saved(trainer.global_step, self.clock())


def _ckpt_io(trainer: Trainer) -> CkptCheckpointIO | None:
    """The Trainer's CkptCheckpointIO, if it uses one."""
    io = trainer.strategy.checkpoint_io
    return io if isinstance(io, CkptCheckpointIO) else None


def _check_strategy(trainer: Trainer) -> None:
    """FSDP, ModelParallel and DeepSpeed save (or load) without CheckpointIO: fail loudly instead of half-working."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)):
        raise RuntimeError(
            f"{type(trainer.strategy).__name__} bypasses CheckpointIO (it writes or reads its own "
            f"torch.distributed.checkpoint / torch.save files), so CkptCheckpointIO cannot checkpoint "
            f"it; use the plain CheckpointManager with DTensor state instead (see docs/integrations.md)"
        )
