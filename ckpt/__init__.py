"""ckpt: save and restore the whole training state, asynchronously and sharded, through tensorstore."""

from .determinism.data import DataMismatchError, RandomWindowSampler, ShuffledSampler, TokenWindowDataset, explain, make_loader
from .errors import (CheckpointDeleteError, CheckpointError, CheckpointWriteError, CorruptCheckpointError,
                     LeaseHeldError, RunMismatchError)
from .manager import CheckpointManager, CheckpointObserver, SaveHandle
from .retention import Retention
from .determinism.rng import RNGState
from .state import Stateful

__all__ = [
    "CheckpointManager", "CheckpointObserver", "SaveHandle", "Retention", "Stateful",
    "CheckpointError", "CheckpointWriteError", "CheckpointDeleteError", "CorruptCheckpointError", "RunMismatchError",
    "LeaseHeldError",
    "RNGState", "RandomWindowSampler", "ShuffledSampler", "TokenWindowDataset", "make_loader", "explain",
    "DataMismatchError",
]
