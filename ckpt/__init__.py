"""ckpt: save and restore the whole training state, asynchronously and sharded, through tensorstore.

The public names load on first use (PEP 562): a process that only reads a root's files through `ckpt.storage`
(ettr's CLI, through `ckpt.storage_args`) does not pay for torch, which the modules behind most of these names import
(~1.2 s to import, ~0.5 s more to tear down).
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports at the end are re-exports, for type checkers and IDEs)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it; __all__, the lazy loader and the type checkers' imports below agree
# (tests/test_architecture.py)
_HOME = {
    "CheckpointManager": "manager",
    "CheckpointObserver": "observer",
    "SaveHandle": "background",
    "WriteOptions": "options",
    "TierOptions": "options",
    "RootOptions": "options",
    "WriteBudget": "budget",
    "Stateful": "state",
    "RetentionPolicy": "retention",
    "KeepLast": "retention",
    "KeepEvery": "retention",
    "KeepBest": "retention",
    "Keep": "retention",
    "SaveDecision": "schedule",
    "EveryNSteps": "schedule",
    "EveryNSeconds": "schedule",
    "AnyOf": "schedule",
    "AdvisedInterval": "schedule",
    "AdvisedTiers": "schedule",
    "Retune": "schedule",
    "Preemption": "schedule",
    "CheckpointError": "errors",
    "CheckpointWriteError": "errors",
    "CollectiveTimeout": "errors",
    "CheckpointDeleteError": "errors",
    "CorruptCheckpointError": "errors",
    "RunMismatchError": "errors",
    "LeaseHeldError": "errors",
    "StepNotFoundError": "errors",
    "StepExistsError": "errors",
    "StorageError": "errors",
    "StateMismatchError": "errors",
    "StateChangedError": "errors",
    "StateKeyError": "errors",
    "DataMismatchError": "errors",
    "PartialCopyError": "errors",
    "RNGState": "determinism.rng",
    "RandomWindowSampler": "determinism.data",
    "ShuffledSampler": "determinism.data",
    "TokenWindowDataset": "determinism.data",
    "make_loader": "determinism.data",
    "explain": "determinism.data",
    "load": "reader",
    "export": "exporter",
    "import_checkpoint": "importers",
}
__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use; the name is then a plain attribute of the package."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .background import SaveHandle
    from .budget import WriteBudget
    from .determinism.data import RandomWindowSampler, ShuffledSampler, TokenWindowDataset, explain, make_loader
    from .determinism.rng import RNGState
    from .errors import (
        CheckpointDeleteError,
        CheckpointError,
        CheckpointWriteError,
        CollectiveTimeout,
        CorruptCheckpointError,
        DataMismatchError,
        LeaseHeldError,
        PartialCopyError,
        RunMismatchError,
        StateChangedError,
        StateKeyError,
        StateMismatchError,
        StepExistsError,
        StepNotFoundError,
        StorageError,
    )
    from .exporter import export
    from .importers import import_checkpoint
    from .manager import CheckpointManager
    from .observer import CheckpointObserver
    from .options import RootOptions, TierOptions, WriteOptions
    from .reader import load
    from .retention import Keep, KeepBest, KeepEvery, KeepLast, RetentionPolicy
    from .schedule import (
        AdvisedInterval,
        AdvisedTiers,
        AnyOf,
        EveryNSeconds,
        EveryNSteps,
        Preemption,
        Retune,
        SaveDecision,
    )
    from .state import Stateful
