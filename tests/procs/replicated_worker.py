"""One rank of the replicated-restore tests (gloo on 127.0.0.1): every rank holds the same state, as under DDP.

Modes: "ddp" (a model, its Adam state and plain tensors, identical on every rank) and "mixed" (the same plus an
HSDP-style DTensor on a 2 x (world/2) mesh, Replicate on the first dimension, Shard(0) on the second, and a
DTensor saved in column shards that every rank restores whole, as a plain tensor). Each rank
saves step 1 (1 MiB digests, so that the large tensors are read in bands by several ranks), zeroes its state and restores it through a `FaultStorage` that counts every byte read; prints one
``RESULT {...}`` line (its pack bytes read, whether every tensor is bitwise the saved one). Then every tensor is set
to 0.5 and step 1 restored again with rank 2's reads of pack data files corrupted: prints ``DAMAGE {...}`` (the error,
whether the state is still all 0.5); then with rank 2's ranged reads of them failing (an I/O error) and again
with none: prints ``UNREADABLE {...}``; then with rank 2's reads corrupted and its read of the manifest failing
(whether the step is still committed: unknown): prints ``UNCHECKED {...}``. Started through `tests/test_distributed.run_ranks(..., worker=replicated_worker)`.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import ckpt
from dist_worker import redirect

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckpt import layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from fault_storage import FaultStorage  # noqa: E402

DAMAGED_RANK = 2


def run(mode: str, root: str, rank: int, world: int, port: int, log: str) -> None:
    redirect(rank, world, port, log)
    main(mode, root)


def build(mode: str, world: int) -> dict:
    """The same state on every rank (one seed): a model and its Adam state after a step, a 16 MiB tensor (read in
    bands by several ranks) and small ones of many sizes; with "mixed", a DTensor replicated over one mesh dimension
    and sharded over the other."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 256, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    state = {
        "model": model,
        "opt": opt,
        "big": torch.randn(1 << 22, generator=g),
        "small": {f"t{i}": torch.randn(17 * i + 1, generator=g).to(torch.bfloat16) for i in range(40)},
    }
    if mode == "mixed":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        whole = torch.randn(2048, 1024, generator=g)
        state["hsdp"] = distribute_tensor(whole, mesh, [Replicate(), Shard(0)], src_data_rank=None)
        columns = torch.randn(64, 4096, generator=g)
        state["columns"] = distribute_tensor(columns, init_device_mesh("cpu", (world,)), [Shard(1)], src_data_rank=None)
    return state


def tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a name (a DTensor's local shard)."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for pid, st in state["opt"].state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v for k, v in st.items()})
    out["big"] = state["big"]
    if "columns" in state:
        out["columns"] = state["columns"]
    out.update({f"small.{k}": v for k, v in state["small"].items()})
    if "hsdp" in state:
        out["hsdp"] = state["hsdp"].to_local()
    return out


def fill(state: dict, value: float) -> None:
    with torch.no_grad():
        for t in tensors(state).values():
            t.fill_(value)


def _data(path: str) -> bool:
    """Whether `path` is a data file of a pack (not its zarr.json)."""
    return "/packs/" in path and "/c/" in path


def pack_bytes(storage: FaultStorage) -> int:
    """Bytes read from the files of the step's packs (its tensors' data)."""
    return sum(n for path, n in storage.read_bytes if _data(path))


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build(mode, world)
    with ckpt.CheckpointManager(root, chunk_bytes=1 << 20, collective_timeout=60) as m:  # 1 MiB digests: bands
        m.save(1, state).wait()
    if "columns" in state:  # saved in column shards, restored whole on every rank: its rows are copied out of them
        state["columns"] = state["columns"].full_tensor()
    reference = {k: v.clone() for k, v in tensors(state).items()}

    fill(state, 0.0)
    counting = FaultStorage(open_storage(root))
    with ckpt.CheckpointManager(counting, collective_timeout=60) as m:
        step = m.restore(state)
    got = tensors(state)
    bad = [k for k in reference if not torch.equal(reference[k], got[k])]
    print("RESULT " + json.dumps({"rank": rank, "step": step, "bytes": pack_bytes(counting), "mismatched": bad}))

    fill(state, 0.5)
    before = {k: v.clone() for k, v in tensors(state).items()}
    damaged = FaultStorage(open_storage(root), corrupt=lambda path: rank == DAMAGED_RANK and _data(path))
    error = None
    with ckpt.CheckpointManager(damaged, collective_timeout=60) as m:
        try:
            m.restore(state, step=1)
        except ckpt.CorruptCheckpointError as e:
            error = str(e)
    after = tensors(state)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    print("DAMAGE " + json.dumps({"rank": rank, "bytes": pack_bytes(damaged), "error": error, "changed": changed}))

    # rank 2's ranged reads of the packs fail (an I/O error, no damage): every rank raises, none takes the step with
    # the bands rank 2 never read, and the ranks stay in step (the restore after it reads step 1 on every rank)
    unreadable = FaultStorage(open_storage(root), fail_range=lambda path: rank == DAMAGED_RANK and _data(path))
    with ckpt.CheckpointManager(unreadable, collective_timeout=60) as m:
        try:
            step, error = m.restore(state), None
        except Exception as e:
            step, error = None, f"{type(e).__name__}: {e}"
        changed = [k for k, v in tensors(state).items() if not torch.equal(before[k], v)]
        unreadable.fail_range = lambda path: False
        again = m.restore(state)
    bad = [k for k, v in tensors(state).items() if not torch.equal(reference[k], v)]
    print(
        "UNREADABLE "
        + json.dumps({"rank": rank, "step": step, "error": error, "changed": changed, "then": again, "mismatched": bad})
    )
    # rank 2 finds damage and cannot ask the root whether the step is still committed (its read of the manifest
    # fails): every rank raises, none waits for rank 2's verdict until the collective timeout
    unchecked = FaultStorage(
        open_storage(root),
        corrupt=lambda path: rank == DAMAGED_RANK and _data(path),
        fail_range=lambda path: rank == DAMAGED_RANK and path.endswith(layout.MANIFEST),
    )
    with ckpt.CheckpointManager(unchecked, collective_timeout=60) as m:
        try:
            m.restore(state, step=1)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    print("UNCHECKED " + json.dumps({"rank": rank, "error": error}))
    dist.barrier()
    dist.destroy_process_group()
