"""One rank of the two-tier distributed tests (gloo on 127.0.0.1, a row-sharded DTensor on a CPU mesh).

Each rank has its own local tier ``ROOT/local<rank>`` (``{rank}`` in the path) and all share the durable root
``ROOT/durable``. Modes: "save" saves steps 1, 2, 3 with persist_every=2 (step 2 is durable; the local tiers and
their peer replicas keep 2 and 3); "restore" restores into zeros and prints the step, the tier and whether every
value is bitwise the saved one ("reshard": as "restore", into column shards); "resume" restores as "restore" does,
then saves the next step. Started through `tests/test_distributed.run_ranks(..., worker=tiers_worker)`.
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckpt
from dist_worker import redirect


class Restores:
    """A CheckpointObserver that records each restore and the tier it read."""

    def __init__(self):
        self.restored = []

    def span(self, category, **attrs):
        import contextlib

        return contextlib.nullcontext()

    def checkpoint_committed(self, step, background_seconds, nbytes, *, tier=None):
        pass

    def checkpoint_restored(self, step, *, tier=None):
        self.restored.append((step, tier))

    def checkpoint_failed(self, step, error):
        pass


def full(step: int) -> torch.Tensor:
    return torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) * step + 0.5


def state(step: int, mesh, dim: int = 0) -> dict:
    return {
        "shard": distribute_tensor(full(step), mesh, [Shard(dim)]),
        "table": torch.full((300,), float(step)),
        "step": step,
    }


def run(mode: str, root: str, rank: int, world: int, port: int, log: str) -> None:
    redirect(rank, world, port, log)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    durable, local = os.path.join(root, "durable"), os.path.join(root, "local{rank}")
    tracker = Restores()
    with ckpt.CheckpointManager(
        durable, local=local, persist_every=2, keep_local=2, tracker=tracker, collective_timeout=30
    ) as m:
        if mode == "save":
            for step in (1, 2, 3):
                m.save(step, state(step, mesh)).wait()
            m.wait()
            print(f"rank {rank} steps {[(int(s), s.tiers) for s in m.steps()]}", flush=True)
        else:
            dim = 1 if mode == "reshard" else 0  # "reshard": the same world size, the shard's columns instead of rows
            got = state(0, mesh, dim)
            got["shard"].to_local().zero_()
            got["table"].zero_()
            step = m.restore(got)
            want = state(step, mesh, dim)
            ok = (
                torch.equal(got["shard"].to_local(), want["shard"].to_local())
                and torch.equal(got["table"], want["table"])
                and got["step"] == step
            )
            print(f"rank {rank} restored {step} tier {tracker.restored[-1][1]} bitwise {ok}", flush=True)
            if mode == "resume":  # training goes on: the next step is saved again
                m.save(step + 1, state(step + 1, mesh)).wait()
                print(f"rank {rank} saved {step + 1}", flush=True)
    dist.destroy_process_group()
    gc.freeze()  # the rank ends here: no final collections over torch's objects (~0.8 s)
    sys.exit(0)
