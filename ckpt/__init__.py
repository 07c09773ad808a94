"""ckpt: save and restore the whole training state, asynchronously and sharded, through tensorstore."""

from .budget import WriteBudget
from .determinism.data import RandomWindowSampler, ShuffledSampler, TokenWindowDataset, explain, make_loader
from .determinism.rng import RNGState
from .errors import (
    CheckpointDeleteError,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DataMismatchError,
    LeaseHeldError,
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
from .manager import CheckpointManager, CheckpointObserver, SaveHandle
from .reader import load
from .retention import Keep, KeepBest, KeepEvery, KeepLast, RetentionPolicy
from .schedule import AdvisedInterval, AnyOf, EveryNSeconds, EveryNSteps, Preemption, SaveDecision
from .state import Stateful

__all__ = [
    "CheckpointManager",
    "CheckpointObserver",
    "SaveHandle",
    "WriteBudget",
    "Stateful",
    "RetentionPolicy",
    "KeepLast",
    "KeepEvery",
    "KeepBest",
    "Keep",
    "SaveDecision",
    "EveryNSteps",
    "EveryNSeconds",
    "AnyOf",
    "AdvisedInterval",
    "Preemption",
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointDeleteError",
    "CorruptCheckpointError",
    "RunMismatchError",
    "LeaseHeldError",
    "StepNotFoundError",
    "StepExistsError",
    "StorageError",
    "StateMismatchError",
    "StateChangedError",
    "StateKeyError",
    "RNGState",
    "RandomWindowSampler",
    "ShuffledSampler",
    "TokenWindowDataset",
    "make_loader",
    "explain",
    "DataMismatchError",
    "load",
    "export",
    "import_checkpoint",
]
