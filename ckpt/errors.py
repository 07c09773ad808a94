"""Exceptions a training loop can catch and act on."""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error this library raises about a checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes do not match what its manifest promises (checksum, size, missing file)."""

    def __init__(self, message: str, *, step: int | None = None, key: str | None = None, file: str | None = None):
        where = ", ".join(f"{k}={v}" for k, v in (("step", step), ("key", key), ("file", file)) if v is not None)
        super().__init__(f"{message} ({where})" if where else message)
        self.message, self.step, self.key, self.file = message, step, key, file


def described(error: BaseException) -> str:
    """An error in one line for a message that crosses ranks or wraps it: its type, then its text."""
    return f"{type(error).__name__}: {error}"


class CheckpointWriteError(CheckpointError):
    """A background write failed; the step it names was not committed and earlier steps are untouched. Except where
    `committed`: a rank went away after rank 0 had committed the step (complete and verified) and before every rank
    heard so, which this rank found in the root; the ranks are out of step all the same."""

    def __init__(self, step: int, cause: BaseException):
        self.committed = bool(getattr(cause, "committed", False))
        if self.committed:
            super().__init__(f"step {step} is committed, but its save did not end on every rank: {described(cause)}")
        else:
            super().__init__(f"saving step {step} failed: {described(cause)}")
        self.step = step
        self.__cause__ = cause


class CollectiveTimeout(CheckpointError):
    """A collective of checkpointing gave up on a rank: no message from it (or to it) within `collective_timeout`, or
    its connection closed (a dead rank, a partitioned node, a stopped process). Names that rank."""

    def __init__(self, op: str, rank: int, waited_for: int | None, cause: BaseException):
        whom = "the other ranks" if waited_for is None else f"rank {waited_for}"
        super().__init__(f"rank {rank} waited for {whom} in {op} and gave up: {cause}")
        self.op, self.rank, self.waited_for = op, rank, waited_for
        self.__cause__ = cause


class StateChangedError(CheckpointError):
    """A tensor of an overlapped snapshot was changed in place before its copy was taken (see `ckpt.snapshot`): the
    save fails, naming the keys, instead of committing a state mixed from before and after the change."""


class CheckpointDeleteError(CheckpointError):
    """A background deletion failed; the step may be partly deleted (its manifest goes first, so it is not restored)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(f"deleting step {step} failed: {described(cause)}")
        self.step = step
        self.__cause__ = cause


class RunMismatchError(CheckpointError):
    """A fresh start found another run's committed steps in its root; nothing was written or deleted."""


class LeaseHeldError(CheckpointError):
    """Another live writer holds the root's lease (or took it over): this process must not write to the root."""

    def __init__(self, message: str, *, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder


class StepNotFoundError(CheckpointError, FileNotFoundError, ValueError):
    """A step asked for is not committed in the root (it has no manifest).

    A FileNotFoundError for readers and a ValueError for a step argument (`delete`), as callers caught before.
    """


class StepExistsError(CheckpointError, FileExistsError, ValueError):
    """A step is already committed: a committed checkpoint is never overwritten (a ValueError, as before)."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to restore does not fit the checkpoint: a tensor's shape or dtype differs (names the key)."""


class StateKeyError(CheckpointError, KeyError):
    """The state passed to restore and the checkpoint have different keys (names the key path)."""


class PartialCopyError(CheckpointError):
    """The step read is one rank's own copy (its local tier, or a peer's replica of it) and lacks a region this
    restore needs: the restore is of another sharding or world size, or not through that rank's manager. No damage:
    the durable copy is read instead, where there is one."""


class DataMismatchError(CheckpointError, ValueError):
    """A sampler state saved for other data or another configuration is being resumed."""


class StorageError(CheckpointError):
    """An object store could not be reached or refused a request: unreachable endpoint, refused credentials, missing
    bucket, or no answer within the root's timeout. The message names the root, endpoint and bucket, and what to check.
    """

    def __init__(self, message: str, *, url: str, endpoint: str | None, bucket: str | None, key: str = ""):
        super().__init__(message)
        self.url, self.endpoint, self.bucket, self.key = url, endpoint, bucket, key


def leader_failure(error: Exception) -> list[Any]:
    """What the leader met reading what every rank needs (a step's manifest and listing, the committed steps), as JSON
    for the other ranks, which each raise `from_leader` of it: no rank reads it again, none waits for it."""
    if isinstance(error, StepNotFoundError):
        return ["vanished", str(error)]
    if isinstance(error, CorruptCheckpointError):
        return ["damaged", error.message, error.step, error.key, error.file]
    return ["refused", described(error)]


def from_leader(told: list[Any], doing: str) -> CheckpointError:
    """On a rank other than the leader, the error `leader_failure` told: a missing step as StepNotFoundError, damage
    as the same CorruptCheckpointError, any other error as a CheckpointError naming rank 0 and what it was `doing`."""
    if told[0] == "vanished":
        return StepNotFoundError(told[1])
    if told[0] == "damaged":
        return CorruptCheckpointError(told[1], step=told[2], key=told[3], file=told[4])
    return CheckpointError(f"rank 0 could not {doing}: {told[1]}")
