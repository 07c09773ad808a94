"""ckpt: save and restore the whole training state, asynchronously and sharded, through tensorstore."""

from .data import RandomWindowSampler, ShuffledSampler, TokenWindowDataset, explain, make_loader
from .errors import (CheckpointDeleteError, CheckpointError, CheckpointWriteError, CorruptCheckpointError,
                     DataMismatchError, LeaseHeldError, RunMismatchError, StateKeyError, StateMismatchError,
                     StepExistsError, StepNotFoundError)
from .manager import CheckpointManager, CheckpointObserver, SaveHandle
from .retention import Retention
from .rng import RNGState
from .state import Stateful

__all__ = [
    "CheckpointManager", "CheckpointObserver", "SaveHandle", "Retention", "Stateful",
    "CheckpointError", "CheckpointWriteError", "CheckpointDeleteError", "CorruptCheckpointError", "RunMismatchError",
    "LeaseHeldError", "StepNotFoundError", "StepExistsError", "StateMismatchError", "StateKeyError",
    "RNGState", "RandomWindowSampler", "ShuffledSampler", "TokenWindowDataset", "make_loader", "explain",
    "DataMismatchError",
]
