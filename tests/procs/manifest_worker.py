"""One rank of the shared-manifest tests (gloo on 127.0.0.1, FSDP2 on a CPU mesh, `dist_worker`'s model): at a restore
from a root every rank shares, the manifest is read from the root by rank 0 alone and sent to the others.

Modes (each rank prints tagged JSON lines, ``TAG {...}``):

- "once": save steps 1 and 2, restore into a fresh model through a `FaultStorage` that records every read: ``ONCE``
  (the step, the tensors that differ from step 2's, the bytes of every manifest.json read through it); again through
  one with direct file IO, which lists the step's files: ``LISTED`` (the same, and the step directories listed).
- "faults": save steps 1 and 2, then restore four times, each into a fresh model, printing what the restore
  returned or raised, the warnings and the tensors that changed: ``AT_REST`` (rank 0 flipped a digit of step 2's
  manifest on disk: every rank falls back to step 1), ``IN_TRANSIT`` (step 2 saved again; rank 0's reads of its
  manifest come back with a bit flipped: the same), ``UNREADABLE`` (step 2 saved again; rank 0's read of its manifest
  fails with an OSError: every rank raises) and ``MISSING`` (`step=2` asked for; rank 0 finds no manifest of step 2:
  every rank raises StepNotFoundError), ``UNLISTABLE`` (rank 0 cannot list the root's steps: every rank raises at
  once, none waits for the list), ``UNLISTED_STEP`` (rank 0 cannot list step 2's files: every rank raises alike) and
  ``MISSING_CHUNK`` (rank 0 deleted the largest file of step 2, a pack's: every rank falls back to step 1 naming it;
  also the step directories each rank listed, and the file deleted).
"""

import json
import os
import re
import sys
import warnings

import torch
import torch.distributed as dist

import ckpt
import dist_worker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckpt.storage import open_storage  # noqa: E402
from fault_storage import FaultStorage  # noqa: E402


def run(mode: str, root: str, rank: int, world: int, port: int, log: str) -> None:
    dist_worker.WORLD = world
    dist_worker.redirect(rank, world, port, log)
    main(mode, root)


def manifest_of(step: int) -> str:
    return f"step_{step:08d}/manifest.json"


def save(root: str, steps, model, opt) -> dict:
    """Train and save `steps`; the full reference of each (every rank: full_tensor() is a collective)."""
    g = torch.Generator().manual_seed(1)
    refs = {}
    with ckpt.CheckpointManager(root, collective_timeout=60) as m:
        for step in steps:
            dist_worker.train(model, opt, g)
            state = dist_worker.state_of(model, opt)
            m.save(step, state).wait()
            refs[step] = dist_worker.flat_reference(model, opt)
    return refs


def mismatched(model, opt, ref: dict) -> list[str]:
    got = dist_worker.flat_reference(model, opt)
    return [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]


def listed(storage: FaultStorage) -> list[str]:
    """The step directories `storage` was asked to list (the direct path of a step directory, `layout.step_files`)."""
    return [p for p in storage.directs if re.fullmatch(r"step_\d{8}", p)]


def attempt(tag: str, storage, ref: dict, step: int | None = None, **extra) -> None:
    """Restore into a fresh model from `storage`; print what happened (never raises: every rank goes on)."""
    rank = dist.get_rank()
    model, opt = dist_worker.build()
    before = dist_worker.flat_reference(model, opt)
    out = {"rank": rank, "step": None, "error": None, "mismatched": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with ckpt.CheckpointManager(storage, collective_timeout=60) as m:
                out["step"] = m.restore(dist_worker.state_of(model, opt), step=step)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    if out["error"] is None:
        out["mismatched"] = mismatched(model, opt, ref)
    else:  # a failed restore leaves the state as it was
        out["changed"] = mismatched(model, opt, before)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if isinstance(storage, FaultStorage):
        out["listed"] = listed(storage)
    out.update(extra)
    print(f"{tag} {json.dumps(out)}", flush=True)
    dist.barrier()


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = dist_worker.build()
    if mode == "once":
        refs = save(root, (1, 2), model, opt)
        model, opt = dist_worker.build()
        counting = FaultStorage(open_storage(root))
        with ckpt.CheckpointManager(counting, collective_timeout=60) as m:
            step = m.restore(dist_worker.state_of(model, opt))
        reads = [(p, n) for p, n in counting.read_bytes if p.endswith("manifest.json")]
        out = {"rank": rank, "step": step, "mismatched": mismatched(model, opt, refs[2]), "manifest_reads": reads}
        print(f"ONCE {json.dumps(out)}", flush=True)
        model, opt = dist_worker.build()
        direct = FaultStorage(open_storage(root), direct=True)
        with ckpt.CheckpointManager(direct, collective_timeout=60) as m:
            step = m.restore(dist_worker.state_of(model, opt))
        reads = [(p, n) for p, n in direct.read_bytes if p.endswith("manifest.json")]
        out = {"rank": rank, "step": step, "mismatched": mismatched(model, opt, refs[2]), "manifest_reads": reads}
        print(f"LISTED {json.dumps({**out, 'listed': listed(direct)})}", flush=True)
    elif mode == "faults":
        refs = save(root, (1, 2), model, opt)
        if rank == 0:  # a digit of the body changed: valid JSON, a wrong checksum
            path = os.path.join(root, manifest_of(2))
            data = bytearray(open(path, "rb").read())
            at = data.index(b'"time":') + len(b'"time":')
            data[at] = ord("1") if data[at] != ord("1") else ord("2")
            open(path, "wb").write(bytes(data))
        dist.barrier()
        attempt("AT_REST", root, refs[1])  # step 2 quarantined by rank 0

        model, opt = dist_worker.build()
        save(root, (2,), model, opt)  # step 2 again: what is read is damaged on the way, rank 0's copy only
        transit = FaultStorage(open_storage(root), corrupt=lambda p: rank == 0 and p == manifest_of(2))
        attempt("IN_TRANSIT", transit, refs[1])

        model, opt = dist_worker.build()
        save(root, (2,), model, opt)
        unreadable = FaultStorage(open_storage(root), fail_read=lambda p: rank == 0 and p == manifest_of(2))
        attempt("UNREADABLE", unreadable, refs[1])

        missing = FaultStorage(open_storage(root), hide=lambda p: rank == 0 and p == manifest_of(2))
        attempt("MISSING", missing, refs[1], step=2)

        unlisted = FaultStorage(open_storage(root), fail_list=lambda p: rank == 0 and p == "")
        attempt("UNLISTABLE", unlisted, refs[1])

        step_2 = FaultStorage(open_storage(root), direct=True, fail_list=lambda p: rank == 0 and p == "step_00000002")
        attempt("UNLISTED_STEP", step_2, refs[1])

        deleted = [None]
        if rank == 0:  # the largest file of step 2: one of a pack's files, which some rank reads
            top = os.path.join(root, "step_00000002")
            files = [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
            deleted[0] = os.path.relpath(max(files, key=os.path.getsize), root)
            os.remove(os.path.join(root, deleted[0]))
        dist.broadcast_object_list(deleted)
        attempt("MISSING_CHUNK", FaultStorage(open_storage(root), direct=True), refs[1], deleted=deleted[0])
    dist.barrier()
    dist.destroy_process_group()
