"""Exceptions a training loop can catch and act on."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error this library raises about a checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes do not match what its manifest promises (checksum, size, missing file)."""

    def __init__(self, message: str, *, step: int | None = None, key: str | None = None, file: str | None = None):
        where = ", ".join(f"{k}={v}" for k, v in (("step", step), ("key", key), ("file", file)) if v is not None)
        super().__init__(f"{message} ({where})" if where else message)
        self.step, self.key, self.file = step, key, file


class CheckpointWriteError(CheckpointError):
    """A background write failed; the step it names was not committed and earlier steps are untouched."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(f"saving step {step} failed: {type(cause).__name__}: {cause}")
        self.step = step
        self.__cause__ = cause


class CheckpointDeleteError(CheckpointError):
    """A background deletion failed; the step may be partly deleted (its manifest goes first, so it is not restored)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(f"deleting step {step} failed: {type(cause).__name__}: {cause}")
        self.step = step
        self.__cause__ = cause


class RunMismatchError(CheckpointError):
    """A fresh start found another run's committed steps in its root; nothing was written or deleted."""


class LeaseHeldError(CheckpointError):
    """Another live writer holds the root's lease (or took it over): this process must not write to the root."""

    def __init__(self, message: str, *, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder
