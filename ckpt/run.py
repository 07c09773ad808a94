"""A root belongs to one run: ``ROOT/run.json`` names it, so a start can tell a restart of that run from another run.

The id of the current run comes from ``run_id=``, else the launcher (``CKPT_RUN_ID``, ``SLURM_JOB_ID``, which a
requeue keeps, or ``TORCHELASTIC_RUN_ID``, which torchrun restarts keep; its default ``none`` is no id), else it
is a fresh random id. The first save of a run into a root records it; a resume claims the root for the resuming run.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from . import catalog, layout
from .errors import CorruptCheckpointError, RunMismatchError
from .layout import RUN_FILE
from .storage import Storage, where

RUN_FORMAT = "ckpt-run/1"
ENV_IDS = ("CKPT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")  # first set one wins


@dataclass(frozen=True)
class Run:
    """A run's id, where the id came from, and the host and time it was made."""

    id: str
    source: str  # "run_id", one of ENV_IDS, or "generated"
    host: str = field(default_factory=socket.gethostname)
    created: float = field(default_factory=time.time)

    @classmethod
    def current(cls, run_id: str | None = None) -> Run:
        """This process's run: `run_id` if given, else the launcher's id from the environment, else a new one."""
        if run_id:
            return cls(str(run_id), "run_id")
        for var in ENV_IDS:
            value = os.environ.get(var, "")
            if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
                return cls(value, var)
        return cls(uuid.uuid4().hex, "generated")

    def describe(self) -> str:
        """One line for error messages."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"run {self.id!r} (id from {self.source}, {when} on {self.host})"


def recorded_run(storage: Storage) -> Run | None:
    """The run recorded in the root, or None (a new root, or one written before run records existed)."""
    data = storage.read(RUN_FILE)
    if data is None:
        return None
    file = where(storage, RUN_FILE)
    try:
        body = json.loads(data)
        body.pop("previous", None)  # `lineage`
        body.pop("durable", None)  # `durable_root`
        if body.pop("format") != RUN_FORMAT:
            raise ValueError(f"format is not {RUN_FORMAT!r}")
        return Run(str(body["id"]), str(body["source"]), str(body["host"]), float(body["created"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"run record is malformed: {e}", file=file) from None


LINEAGE = 1000  # run ids a root remembers having recorded before its current one (~40 bytes each)


def claim(storage: Storage, run: Run, *, durable: str | None = None) -> None:
    """Record `run` as the root's run (atomically), unless it already is; a malformed record is replaced. The ids it
    recorded before are kept (`lineage`). `durable`: the root is a local tier, and this the URL of its durable root.

    A save records its run in every rank's local tier before its durable root does, so a local tier's lineage holds
    the run its durable root records whatever instant an attempt died at (`tiers.Tiers.other_run`)."""
    try:
        recorded = recorded_run(storage)
        before = lineage(storage)
    except CorruptCheckpointError:
        recorded, before = None, []
    if recorded is None or recorded.id != run.id:
        body = {"format": RUN_FORMAT, **asdict(run), "previous": before[:LINEAGE]}
        storage.write_atomic(RUN_FILE, json.dumps(body | ({"durable": durable} if durable else {})).encode())


def lineage(storage: Storage) -> list[str]:
    """The ids of the runs the root recorded, newest first: its current run's, then those it replaced."""
    recorded = recorded_run(storage)
    return [] if recorded is None else [recorded.id, *_extra(storage)["previous"]]


def durable_root(storage: Storage) -> str | None:
    """The URL of the durable root a local tier records that it belongs to (None: not a local tier, or older)."""
    return _extra(storage)["durable"]


def _extra(storage: Storage) -> dict[str, Any]:
    """A run record's fields beside the run itself, checked."""
    data = storage.read(RUN_FILE)
    try:
        body = json.loads(data) if data is not None else {}
    except ValueError as e:
        raise CorruptCheckpointError(f"run record is malformed: {e}", file=where(storage, RUN_FILE)) from None
    previous, durable = body.get("previous", []), body.get("durable")
    if not (isinstance(previous, list) and all(isinstance(p, str) for p in previous)) or not (
        durable is None or isinstance(durable, str)
    ):
        raise CorruptCheckpointError("run record is malformed: previous or durable", file=where(storage, RUN_FILE))
    return {"previous": previous, "durable": durable}


def check_start(
    storage: Storage, run: Run, *, resume: bool, how_to_resume: str | Callable[[], str], how_to_start_over: str
) -> bool:
    """Decide at a training start, before anything is written: True to resume the root's newest step.

    A root without committed steps starts fresh (False). An explicit `resume` takes the root over (True). A fresh
    start resumes silently only when the root's recorded run is `run` (a restart by torchrun, a requeue, an
    explicit run id); otherwise it raises `RunMismatchError`, saying how to resume or start over (`how_to_resume`
    may be a function: what it reads to say so is read only for a refusal).
    """
    committed = layout.committed_steps(storage)
    if not committed:
        return False
    recorded = recorded_run(storage)
    if not resume and (recorded is None or recorded.id != run.id):
        owner = recorded.describe() if recorded is not None else "a run that recorded no id"
        raise RunMismatchError(
            f"{storage.url} holds committed steps {committed} of {owner}, and this fresh start is {run.describe()}. "
            f"Nothing was written or deleted. To resume that run: "
            f"{how_to_resume() if callable(how_to_resume) else how_to_resume}. To start over: {how_to_start_over}. "
            f"A restart resumes by itself when it carries the recorded id (run_id=, or CKPT_RUN_ID, SLURM_JOB_ID, "
            f"TORCHELASTIC_RUN_ID in the environment)."
        )
    claim(storage, run)
    return True


def discard(storage: Storage) -> list[int]:
    """Delete every committed step, the leftovers of dead saves and the run record: an explicit start-over."""
    steps = layout.committed_steps(storage)
    for step in reversed(steps):
        catalog.delete_step(storage, step)
    catalog.collect_garbage(storage)
    storage.delete_file(RUN_FILE)
    return steps
