"""ckpt: save and restore the whole training state, asynchronously and sharded, through tensorstore."""

from .errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from .manager import CheckpointManager, CheckpointObserver, SaveHandle
from .retention import Retention
from .state import Stateful

__all__ = [
    "CheckpointManager", "CheckpointObserver", "SaveHandle", "Retention", "Stateful",
    "CheckpointError", "CheckpointWriteError", "CorruptCheckpointError",
]
